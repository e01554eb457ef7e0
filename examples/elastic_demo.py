"""The main demo: train, stop mid-run, and resume on a different number of replicas.

    python examples/elastic_demo.py

It runs ``examples/linear_regression.py`` under ``adaptive-run`` with 2
replicas, sends SIGTERM (what a scheduler or Ctrl-C does) once a few epochs
are done, and relaunches the same command with 3 replicas: training resumes
from the checkpoint at the exact step and finishes.  Checkpoints go to
``runs/demo/checkpoints``; pass ``--fresh`` to start over.
"""
import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

from adaptive.runtime.process_tree import kill_process_tree

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "linear_regression.py")


def launch(nproc: int, env: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "adaptive.elastic.launcher", "--standalone", f"--nproc-per-node={nproc}", SCRIPT]
    print(f"\n$ adaptive-run --standalone --nproc-per-node={nproc} {os.path.relpath(SCRIPT)}", flush=True)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def relay(proc: subprocess.Popen, stop_after_epoch: int | None, deadline: float) -> int:
    """Show the job's own log lines; SIGTERM it once the given epoch is logged."""
    for line in proc.stdout:
        if "Warning" in line or line.startswith(("W1", "I1", "*")) or not line.strip():
            continue
        print("   ", line.rstrip(), flush=True)
        if stop_after_epoch is not None and f"epoch {stop_after_epoch}:" in line:
            print(f"\n>>> sending SIGTERM to the job after epoch {stop_after_epoch}", flush=True)
            os.killpg(proc.pid, signal.SIGTERM)
            stop_after_epoch = None
        if time.monotonic() > deadline:
            kill_process_tree(proc.pid)
            raise SystemExit("demo: the job took too long")
    return proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fresh", action="store_true", help="delete earlier checkpoints first")
    parser.add_argument("--run-dir", default="runs/demo", help="where checkpoints and metrics go")
    args = parser.parse_args()
    if args.fresh:
        shutil.rmtree(args.run_dir, ignore_errors=True)
    env = dict(os.environ, ADAPTIVE_CHECKPOINT_PATH=os.path.join(args.run_dir, "checkpoints"),
               ADAPTIVE_SHARE_PATH=os.path.join(args.run_dir, "share"), OMP_NUM_THREADS="1")
    deadline = time.monotonic() + 600
    first = relay(launch(2, env), stop_after_epoch=3, deadline=deadline)
    print(f">>> the job exited with {first} (143 = stopped gracefully after a checkpoint)")
    second = relay(launch(3, env), stop_after_epoch=None, deadline=deadline)
    print(f">>> the job exited with {second}: {'finished' if second == 0 else 'FAILED'}")
    sys.exit(second)


if __name__ == "__main__":
    main()
