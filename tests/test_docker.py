"""The Dockerfiles stay buildable and in step with the README (no Docker engine is needed).

* each image installs the project exactly as the README's install step does;
* every file a COPY names exists in the build context (the repository root),
  and everything that install step reads is copied before it runs;
* the entrypoints, modules and repository paths the files name exist.
"""

from __future__ import annotations

import fnmatch
import importlib
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCKERFILES = sorted((REPO / "docker").glob("Dockerfile*"))

#: pip options that change how, not what, is installed.
_COSMETIC_FLAGS = {"--no-cache-dir", "-q", "-qq", "--quiet", "--disable-pip-version-check", "--no-input"}
_COSMETIC_WITH_VALUE = {"--progress-bar", "--root-user-action"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    result, pending = [], ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, arguments = line.partition(" ")
        result.append((keyword.upper(), arguments.strip()))
    return result


def comments(path: Path) -> str:
    return "\n".join(line for line in path.read_text(encoding="utf-8").splitlines() if line.lstrip().startswith("#"))


def pip_installs(command: str) -> list[list[str]]:
    """The argument lists of every ``pip install`` in a shell command line."""
    found = []
    for part in re.split(r"&&|;|\|\|", command):
        words = shlex.split(part)
        for start in range(len(words)):
            if words[start:start + 2] == ["pip", "install"] or words[start:start + 4] == ["python", "-m", "pip",
                                                                                             "install"]:
                found.append(words[start + (2 if words[start] == "pip" else 4):])
                break
    return found


def normalised(arguments: list[str]) -> list[str]:
    """Drop options that do not change what gets installed."""
    out, skip = [], False
    for word in arguments:
        if skip:
            skip = False
            continue
        if word in _COSMETIC_FLAGS or any(word.startswith(flag + "=") for flag in _COSMETIC_WITH_VALUE):
            continue
        if word in _COSMETIC_WITH_VALUE:
            skip = True
            continue
        out.append(word)
    return out


def readme_install_step() -> list[str]:
    """The ``pip install`` of the README's first code block (its set-up-and-run command)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert blocks, "README.md has no code block"
    installs = pip_installs(blocks[0].replace("\\\n", " "))
    assert installs, "the README's first code block has no pip install step"
    return normalised(installs[0])


def copies(path: Path) -> list[tuple[int, list[str]]]:
    """(instruction index, sources) of every COPY/ADD from the build context."""
    result = []
    for index, (keyword, arguments) in enumerate(instructions(path)):
        if keyword not in ("COPY", "ADD"):
            continue
        if arguments.startswith("["):
            words = re.findall(r'"([^"]*)"', arguments)
        else:
            words = shlex.split(arguments)
        if any(word.startswith("--from") for word in words):
            continue  # from another build stage, not the context
        words = [word for word in words if not word.startswith("--")]
        result.append((index, words[:-1]))
    return result


def required_by_install(arguments: list[str], base: Path = REPO) -> set[str]:
    """Repository paths a pip install with these arguments reads (requirement files, the project)."""
    needed: set[str] = set()
    words = list(arguments)
    for position, word in enumerate(words):
        if word in ("-r", "--requirement") and position + 1 < len(words):
            needed |= requirement_file_needs(base / words[position + 1])
        elif word in ("-e", "--editable") and position + 1 < len(words):
            needed |= project_needs(words[position + 1])
        elif word == "." or word.startswith(".["):
            needed |= project_needs(word)
    return needed


def requirement_file_needs(path: Path) -> set[str]:
    needed = {str(path.relative_to(REPO))}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            needed |= required_by_install(shlex.split(line), base=path.parent)
    return needed


def project_needs(spec: str) -> set[str]:
    """setup.py, the files it opens, and the packages it installs."""
    if not spec.startswith("."):
        return set()
    setup = (REPO / "setup.py").read_text(encoding="utf-8")
    opened = set(re.findall(r"open\(\s*[\"']([^\"']+)[\"']", setup))
    include = re.search(r"include=\[([^\]]*)\]", setup)
    names = re.findall(r"[\"']([\w.*]+)[\"']", include.group(1)) if include else []
    packages = {name.split(".")[0] for name in names}
    return {"setup.py", *opened, *packages}


def covered(path: str, sources: list[str]) -> bool:
    return any(source in (".", "./") or path == source.rstrip("/") or path.startswith(source.rstrip("/") + "/")
               for source in sources)


def test_there_are_dockerfiles_for_training_and_the_scheduler():
    names = {path.name for path in DOCKERFILES}
    assert {"Dockerfile.train", "Dockerfile.scheduler"} <= names


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_install_step_is_the_readmes(dockerfile):
    expected = readme_install_step()
    found = [normalised(arguments) for keyword, command in instructions(dockerfile) if keyword == "RUN"
             for arguments in pip_installs(command)]
    assert found, f"{dockerfile.name} has no pip install step"
    for arguments in found:
        assert arguments == expected, (f"{dockerfile.name} installs `pip install {' '.join(arguments)}`, the README "
                                       f"`pip install {' '.join(expected)}`")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_copy_source_exists(dockerfile):
    all_copies = copies(dockerfile)
    assert all_copies, f"{dockerfile.name} copies nothing"
    missing = [source for _, sources in all_copies for source in sources
               if not any(REPO.glob(source.rstrip("/"))) and not (REPO / source).exists()]
    assert not missing, f"{dockerfile.name} copies files that are not in the repository: {missing}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_what_the_install_reads_is_copied_before_it(dockerfile):
    steps = instructions(dockerfile)
    install_at = next(index for index, (keyword, command) in enumerate(steps)
                      if keyword == "RUN" and pip_installs(command))
    arguments = pip_installs(steps[install_at][1])[0]
    sources = [source for index, sources in copies(dockerfile) if index < install_at for source in sources]
    needed = sorted(required_by_install(arguments))
    assert needed, "the install step reads nothing from the repository?"
    missing = [path for path in needed if not covered(path, sources)]
    assert not missing, f"{dockerfile.name}: the pip install step needs {missing}, not copied before it"
    ignore = REPO / ".dockerignore"
    if ignore.exists():
        patterns = [line.strip() for line in ignore.read_text().splitlines() if line.strip() and line[0] != "#"]
        excluded = [path for path in needed if any(fnmatch.fnmatch(path, pattern) for pattern in patterns)]
        assert not excluded, f".dockerignore excludes {excluded}, which the image's install step needs"


def console_scripts() -> set[str]:
    setup = (REPO / "setup.py").read_text(encoding="utf-8")
    return set(re.findall(r"[\"']([\w-]+)\s*=\s*[\w.]+:\w+[\"']", setup))


def module_exists(name: str) -> bool:
    base = REPO.joinpath(*name.split("."))
    return base.with_suffix(".py").exists() or (base / "__main__.py").exists()


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_entrypoints_modules_and_paths_named_exist(dockerfile):
    problems = []
    for keyword, arguments in instructions(dockerfile):
        if keyword in ("ENTRYPOINT", "CMD") and arguments.startswith("["):
            program = re.findall(r'"([^"]*)"', arguments)
            if program and program[0] not in ("python", "python3", "sh", "bash") and \
                    program[0] not in console_scripts():
                problems.append(f"{keyword} runs {program[0]}, which setup.py does not install")
    text = dockerfile.read_text(encoding="utf-8")
    for module in re.findall(r"python3? -m ([\w.]+)", text):
        if module.split(".")[0] in ("adaptive", "scheduler") and not module_exists(module):
            problems.append(f"python -m {module}: no such module")
    repo_path = r"(?<![\w/])((?:examples|scheduler|adaptive|docs|benchmarks)/[\w./-]*\w)"
    for path in re.findall(repo_path, comments(dockerfile)):
        if not (REPO / path).exists():
            problems.append(f"{path}: no such file")
    assert not problems, f"{dockerfile.name}: {problems}"


def documented_commands(dockerfile: Path) -> list[list[str]]:
    """The ``docker ...`` commands shown in a Dockerfile's comments, continuation lines joined."""
    commands, pending = [], ""
    for line in comments(dockerfile).splitlines():
        text = line.lstrip()[1:].strip()
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        text, pending = pending + text, ""
        if text.startswith("docker "):
            commands.append(shlex.split(text))
    return commands


def image_run_arguments(dockerfile: Path) -> list[tuple[list[str], list[str]]]:
    """(docker options, arguments after the image) of each documented ``docker run`` of the built image."""
    commands = documented_commands(dockerfile)
    tags = {command[command.index("-t") + 1] for command in commands if command[:2] == ["docker", "build"]
            and "-t" in command}
    assert tags, f"{dockerfile.name}: the comments show no `docker build ... -t NAME` command"
    runs = []
    for command in commands:
        if command[:2] == ["docker", "run"]:
            at = next((i for i, word in enumerate(command) if word in tags), None)
            assert at is not None, f"{dockerfile.name}: `{' '.join(command)}` does not run the built image"
            runs.append((command[2:at], command[at + 1:]))
    return runs


def parser_error(module: str, arguments: list[str]) -> str | None:
    """Why ``python -m module arguments`` would be refused by its argument parser, or None."""
    if module == "adaptive.elastic.launcher":
        from adaptive.elastic.launcher import build_args
        parse = build_args
    else:
        is_file = REPO.joinpath(*module.split(".")).with_suffix(".py").exists()
        imported = importlib.import_module(module if is_file else module + ".__main__")
        if not hasattr(imported, "_parser"):
            return None
        parse = imported._parser().parse_args
    try:
        parse(arguments)
    except SystemExit as stop:
        return f"python -m {module} {' '.join(arguments)}: rejected by its argument parser (exit {stop.code})"
    return None


def read_by_the_code(variable: str) -> bool:
    return any(variable in path.read_text(encoding="utf-8")
               for folder in ("adaptive", "scheduler") for path in (REPO / folder).rglob("*.py"))


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_documented_docker_commands_are_accepted(dockerfile, capsys):
    """What the comments tell a newcomer to type parses, and the variables it sets are read."""
    entrypoint = [re.findall(r'"([^"]*)"', arguments) for keyword, arguments in instructions(dockerfile)
                  if keyword == "ENTRYPOINT"]
    problems = []
    for options, arguments in image_run_arguments(dockerfile):
        for flag, value in zip(options, options[1:]):
            if flag in ("-e", "--env") and "=" in value and not read_by_the_code(value.split("=")[0]):
                problems.append(f"-e {value}: no code reads {value.split('=')[0]}")
        if arguments[:2] in (["python", "-m"], ["python3", "-m"]):
            problems.append(parser_error(arguments[2], arguments[3:]))
        elif entrypoint and entrypoint[-1] == ["adaptive-run"]:
            problems.append(parser_error("adaptive.elastic.launcher", arguments))
    capsys.readouterr()  # argparse's usage messages
    problems = [problem for problem in problems if problem]
    assert not problems, f"{dockerfile.name}: {problems}"


def test_the_checks_catch_a_broken_dockerfile(tmp_path):
    """A Dockerfile that installs more than the README, copies a missing file and forgets README.md."""
    broken = tmp_path / "Dockerfile.broken"
    broken.write_text("FROM python:3.11-slim\n"
                      "COPY setup.py requirements.txt ./\n"
                      "COPY adaptive ./adaptive\n"
                      "COPY scheduler \\\n     ./scheduler\n"
                      "COPY no-such-file.txt ./\n"
                      "RUN pip install --no-cache-dir -r requirements.txt && pip install -q matplotlib\n")
    installs = [normalised(a) for k, c in instructions(broken) if k == "RUN" for a in pip_installs(c)]
    assert installs == [readme_install_step(), ["matplotlib"]]
    sources = [source for _, group in copies(broken) for source in group]
    assert sources == ["setup.py", "requirements.txt", "adaptive", "scheduler", "no-such-file.txt"]
    assert not (REPO / "no-such-file.txt").exists()
    needed = required_by_install(readme_install_step())
    assert [path for path in sorted(needed) if not covered(path, sources)] == ["README.md"]
