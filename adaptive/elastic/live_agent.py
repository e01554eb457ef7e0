"""The agent of ``adaptive-run --live``: this node's workers, kept running across membership changes.

torchrun's agent restarts every worker of every node whenever the
membership changes; in live mode this agent takes its place (same
arguments: ``--nnodes MIN:MAX``, ``--nproc-per-node``, ``--rdzv-endpoint``,
``--standalone``, ``--max-restarts``) and leaves membership to the workers
(:mod:`adaptive.runtime.membership`, :mod:`adaptive.elastic.live`):

* the job's TCPStore listens on the rendezvous endpoint; the first agent
  there hosts it, the others connect to it.  The hosting agent stays up,
  serving the store, until every other agent of the job is done (its own
  workers may leave before);
* it starts ``--nproc-per-node`` workers, each bound to it (they die with
  it, whatever kills it) and told the store, this node's number and the
  job's minimum and maximum size.  Each worker is a fork of this node's
  pre-warmed process, which imported torch, ``torch._dynamo`` and the library
  (and the modules named with ``--preload``) once, while the agent joined
  the job (:mod:`adaptive.elastic.warm_start`); with ``--cold-start``, or
  when that process cannot serve, a worker is a new interpreter;
* a worker that exits with 0 (training done) or 143 (it left, or the job
  stopped, with nothing lost) is done; a worker that fails is started again
  (at most ``--max-restarts`` times per agent) and joins the running job,
  taking its state from its peers, or forms a new generation from the
  checkpoint when no member is left; a worker fenced by a newer incarnation
  (exit 3) ends this agent with 3;
* a worker that the other members took out of the job as hung (it gave no
  sign of life for ``ADAPTIVE_LIVE_HANG_TIMEOUT``: stopped, or stuck) is
  killed, with its process tree, and started again like a failed one: it
  joins the running job anew;
* SIGTERM or SIGINT is passed to the workers, which leave the job at their
  next agreed step (the others continue); when every agent is stopped the
  last members checkpoint and the job stops as without live mode.
* a node asked to drain (``adaptive drain``, :mod:`adaptive.runtime.draining`)
  sees its workers leave at the job's next agreement, with nothing lost, and
  starts none of them again.

The job's store listens on the endpoint's address only and serves one job
(:mod:`adaptive.elastic.live_store`): a launcher of another job is refused
with 2.  With ``ADAPTIVE_LIVE_SECRET`` (or ``ADAPTIVE_LIVE_SECRET_FILE``)
the job's records are signed (:mod:`adaptive.runtime.signed_records`): the
agent hands the secret to its workers, signs its own records and claims its
node number; a launcher with another secret is refused with 2 too.  When
the node that hosts it is lost, the others end their workers
and exit with 75, for a supervisor to relaunch them (the job resumes from
its newest checkpoint).

Exit status: 0 when every worker finished, 143 when they left (drained too) or
stopped gracefully, 3 when fenced, 1 when a worker failed more often than
allowed, 2 when the endpoint serves another job or a worker exited with 2 (a
usage error, which a restart cannot fix: it is not started again), 75 when the
job's store was lost with its host node.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import secrets
import signal
import subprocess
import time
from argparse import Namespace
from types import FrameType

import portpicker

from adaptive.elastic import live_store
from adaptive.elastic.warm_start import WarmStarter, WarmWorker, worker_command
from adaptive.runtime import draining, env, launch_status, live_protocol, membership, process_tree
from adaptive.runtime.liveness import BEAT_INTERVAL  # an agent's signs of life come as often as a worker's

__all__ = ["run", "LiveConfig", "LiveAgent", "DONE_EXIT_CODES", "STORE_LOST_EXIT_CODE"]

logger = logging.getLogger(__name__)

#: Worker exit statuses after which its slot is done (not restarted): finished, left or stopped.
DONE_EXIT_CODES = (0, 143)
#: Seconds between looks at the workers.
POLL = 0.05
#: Seconds the workers get to leave after a stop signal before they are killed.
STOP_GRACE = 60.0
#: Seconds the job's store may fail to answer before this node ends (its host node was lost).
STORE_LOSS_GRACE = 3.0
#: Exit status after the job's store was lost with its host node: relaunch (sysexits' EX_TEMPFAIL).
STORE_LOST_EXIT_CODE = 75
#: The most nodes the hosting agent looks at when it waits for the others to be done.
MAX_NODES = 4096


@dataclasses.dataclass(frozen=True)
class LiveConfig:
    """What a live agent runs and how: the typed form of ``adaptive-run --live``'s arguments."""

    script: str  # the training script (or module, with ``module``)
    script_args: tuple[str, ...]
    module: bool
    per_node: int  # workers on this node (--nproc-per-node)
    smallest: int  # the fewest workers the job trains with (--nnodes MIN times per_node)
    largest: int  # the most workers the job admits (--nnodes MAX times per_node)
    max_restarts: int  # restarts of failed workers this agent may spend
    host: str  # the job's store: the rendezvous endpoint (127.0.0.1 and a free port with --standalone)
    port: int
    job_id: str  # the job's name in the store (ADAPTIVE_JOB_ID, else the script's name)
    rdzv_id: str  # --rdzv-id: launchers of one job give the same (torchrun's default "none" included)
    cold_start: bool = False
    preload: tuple[str, ...] = ()

    def identity(self) -> live_store.JobIdentity:
        """What the job's other launchers must share with this one."""
        return live_store.JobIdentity(self.job_id, self.rdzv_id, self.script,
                                      ("-m",) * self.module + self.script_args)

    @classmethod
    def from_args(cls, args: Namespace) -> LiveConfig:
        """Check and type torchrun's parsed arguments (a clear error names the argument)."""
        try:
            per_node = int(args.nproc_per_node)
        except ValueError:
            per_node = 0
        if per_node < 1:
            raise SystemExit(f"adaptive-run --live: --nproc-per-node must be a number >= 1, got {args.nproc_per_node!r}")
        smallest, largest = _size_bounds(args, per_node)
        host, port = _endpoint(args)
        return cls(script=str(args.training_script), script_args=tuple(args.training_script_args),
                   module=bool(args.module), per_node=per_node, smallest=smallest, largest=largest,
                   max_restarts=int(args.max_restarts), host=host, port=port, job_id=_job_id(args),
                   rdzv_id=str(args.rdzv_id),
                   cold_start=bool(args.cold_start), preload=tuple(args.preload))


@dataclasses.dataclass
class WorkerSlot:
    """One local rank of this node: its process while it runs, how it last ended, how often it was started."""

    process: subprocess.Popen[bytes] | WarmWorker | None = None
    exit_code: int | None = None
    starts: int = 0

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


def _endpoint(args: Namespace) -> tuple[str, int]:
    if args.standalone or not args.rdzv_endpoint:
        return "127.0.0.1", portpicker.pick_unused_port()
    try:
        return env.parse_endpoint("--rdzv-endpoint", args.rdzv_endpoint)
    except ValueError as error:
        raise SystemExit(f"adaptive-run --live: {error}") from None


def _size_bounds(args: Namespace, per_node: int) -> tuple[int, int]:
    low, _, high = str(args.nnodes).partition(":")
    try:
        smallest, largest = int(low), int(high or low)
    except ValueError:
        raise SystemExit(f"adaptive-run --live: --nnodes must be N or MIN:MAX, got {args.nnodes!r}") from None
    if not 1 <= smallest <= largest:
        raise SystemExit(f"adaptive-run --live: --nnodes needs 1 <= MIN <= MAX, got {args.nnodes!r}")
    return smallest * per_node, largest * per_node


def _job_id(args: Namespace) -> str:
    """The job's name, as its workers would take it (``ADAPTIVE_JOB_ID``, else the script's or module's name)."""
    if env.job_id_given():
        return env.job_id()
    script = str(args.training_script)
    stem = script.rsplit(".", 1)[-1] if args.module else os.path.splitext(os.path.basename(script))[0]
    return re.sub(r"[^A-Za-z0-9._-]", "_", stem or "default")


class LiveAgent:
    """Starts, watches and restarts this node's workers (see the module docstring)."""

    def __init__(self, config: LiveConfig, status_dir: str, warm: WarmStarter | None = None) -> None:
        self.config = config
        self.warm = warm
        self.restarts_left = config.max_restarts
        self.hosted = live_store.host_or_connect(config.host, config.port)
        self.store, self.hosting = self.hosted.store, self.hosted.hosting
        live_store.claim_identity(self.store, config.identity())
        self.agents = membership.agents_store(self.store)  # the launchers' records, signed with the job's secret
        self.node = self._claim_node()
        self.store_lost_at: float | None = None  # when the store first failed to answer (monotonic)
        self._beat()
        self.status_dir = status_dir
        self.job_store = membership.job_store(self.store, config.job_id)  # the job's keys on the store
        self.slots = {local_rank: WorkerSlot() for local_rank in range(config.per_node)}
        self.stopping = False

    def _claim_node(self) -> int:
        """This launcher's node number: the next of the launchers' counter; with a secret also claimed with a
        signed record, skipping numbers another launcher holds (a counter set back would give one twice)."""
        from adaptive.runtime import signed_records

        if not signed_records.is_signed(self.agents):
            return int(self.store.add(live_protocol.AGENTS_KEY, 1))
        token = f"{os.getpid()}/{secrets.token_hex(8)}"
        for _ in range(membership.CLAIM_ATTEMPTS):
            node = int(self.store.add(live_protocol.AGENTS_KEY, 1))
            if self.agents.compare_set(live_protocol.agent_claim_key(node), "", token).decode() == token:
                return node
        raise SystemExit(f"adaptive-run --live: no free node number after {membership.CLAIM_ATTEMPTS} tries: the "
                         f"counter {live_protocol.AGENTS_KEY!r} on the job's store is being set back")

    def _environment(self, local_rank: int) -> dict[str, str]:
        config = self.config
        environment = process_tree.child_environment()
        secret = env.live_secret()
        if secret is not None:  # the workers sign with the launcher's secret, however it was given
            environment.pop(env.LIVE_SECRET_FILE_VAR, None)
            environment[env.LIVE_SECRET_VAR] = secret.decode()
        environment.update({
            env.LIVE_STORE_VAR: f"{config.host}:{config.port}", env.LIVE_NODE_VAR: str(self.node),
            env.LIVE_MIN_VAR: str(config.smallest), env.LIVE_MAX_VAR: str(config.largest),
            "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(config.per_node), "MASTER_ADDR": config.host,
            "TORCHELASTIC_RESTART_COUNT": str(self.slots[local_rank].starts),
            launch_status.STATUS_DIR_VAR: self.status_dir, "ADAPTIVE_JOB_ID": config.job_id,
        })
        for name in ("RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_PORT"):
            environment.pop(name, None)  # the membership decides them
        return environment

    def _start(self, local_rank: int) -> None:
        config, slot = self.config, self.slots[local_rank]
        environment = self._environment(local_rank)
        forked = None if self.warm is None else self.warm.start(config.script, config.module,
                                                                  list(config.script_args), environment)
        if forked is not None:
            slot.process = forked
            logger.info("adaptive-run --live: node %d forks worker %d from its pre-warmed process", self.node,
                        local_rank)
        else:
            command = worker_command(config.script, config.module, list(config.script_args))
            cold = slot.process = subprocess.Popen(command, env=environment)
            logger.info("adaptive-run --live: node %d started worker %d (pid %d)", self.node, local_rank, cold.pid)
        slot.starts += 1

    def stop(self, signum: int, frame: FrameType | None = None) -> None:
        """Pass a stop to the workers: they leave the job at their next agreed step."""
        if self.stopping:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.stopping = True
        logger.warning("adaptive-run --live: received %s; the workers of node %d leave the job",
                       signal.Signals(signum).name, self.node)
        for slot in self.slots.values():
            if slot.running():
                assert slot.process is not None
                slot.process.send_signal(signal.SIGTERM)

    def _beat(self, done: bool = False) -> None:
        """Tell the other agents (the hosting one) that this one lives, or that it is done."""
        self.agents.set(live_protocol.agent_key(self.node), "done" if done else repr(time.time()))
        self.beaten = time.monotonic()

    def run(self) -> int:
        """Run the workers until every one of them is done; the agent's exit status."""
        for local_rank in self.slots:
            self._start(local_rank)
        stop_deadline: float | None = None
        while any(slot.process is not None for slot in self.slots.values()):
            time.sleep(POLL)
            if time.monotonic() - self.beaten > BEAT_INTERVAL:
                if not self._beat_or_note_loss():
                    return self._end_without_store()
                self._kill_hung()
            if self.stopping and stop_deadline is None:
                stop_deadline = time.monotonic() + STOP_GRACE
            if stop_deadline is not None and time.monotonic() > stop_deadline:
                logger.error("adaptive-run --live: the workers did not leave within %.0f s; killing them", STOP_GRACE)
                self._kill_all()
                return 1
            for local_rank, slot in self.slots.items():
                code = None if slot.process is None else slot.process.poll()
                if code is None:
                    continue
                status = self._worker_exited(local_rank, code)
                if status is not None:
                    return status
        return self._exit_status()

    def _beat_or_note_loss(self) -> bool:
        """A sign of life; False once the store has not answered for :data:`STORE_LOSS_GRACE` seconds."""
        try:
            self._beat()
        except (RuntimeError, OSError) as error:  # DistNetworkError, DistStoreError: the host node is gone
            now = time.monotonic()
            if self.store_lost_at is None:
                self.store_lost_at = now
                logger.debug("the job's store did not answer: %s", error)
            self.beaten = now
            return now - self.store_lost_at < STORE_LOSS_GRACE
        self.store_lost_at = None
        return True

    def _end_without_store(self) -> int:
        """The node that hosts the job's store was lost: end this node, for a supervisor to relaunch it."""
        logger.error("adaptive-run --live: the job's store at %s:%d has not answered for %.0f s (the node that "
                     "hosted it was lost); ending node %d with %d: relaunch the job's nodes to resume from its "
                     "newest checkpoint", self.config.host, self.config.port, STORE_LOSS_GRACE, self.node,
                     STORE_LOST_EXIT_CODE)
        self._kill_all()
        return STORE_LOST_EXIT_CODE

    def _worker_exited(self, local_rank: int, code: int) -> int | None:
        """Restart or retire a worker that exited; an exit status when the whole agent must end now."""
        slot = self.slots[local_rank]
        exited = slot.process
        assert exited is not None, "a worker that exited ran"
        slot.process, slot.exit_code = None, code
        if code == launch_status.STALE_GENERATION_EXIT_CODE or launch_status.stale_report(self.status_dir):
            logger.error("adaptive-run --live: a newer incarnation of the job took over; ending this one")
            self._kill_all()
            return launch_status.STALE_GENERATION_EXIT_CODE
        if code in DONE_EXIT_CODES:
            return None
        self._say_dead(local_rank, exited.pid)
        if code == live_store.CONFIG_ERROR_EXIT_CODE:  # Python's own status for a bad argument or a missing script
            logger.error("adaptive-run --live: worker %d exited with %d, a usage or configuration error (a bad "
                         "argument, a script that cannot be opened, a checkpoint folder that cannot be created) "
                         "that a restart cannot fix; ending node %d", local_rank, code, self.node)
            self._kill_all()
            return live_store.CONFIG_ERROR_EXIT_CODE
        if not self._store_answers():  # the job cannot go on without its store (a leave in flight neither)
            return self._end_without_store()
        if self.stopping or self._drained():
            return None
        if self.restarts_left <= 0:
            logger.error("adaptive-run --live: worker %d failed with %d and no restarts are left", local_rank, code)
            self._kill_all()
            return 1
        self.restarts_left -= 1
        logger.warning("adaptive-run --live: worker %d exited with %d; starting it again (%d restarts left)",
                       local_rank, code, self.restarts_left)
        self._start(local_rank)
        return None

    def _worker_id(self, local_rank: int, pid: int | None) -> int | None:
        """The job's id of this node's worker ``local_rank``, process ``pid`` (None before it joined, or when the
        record is an older worker's: it names another PID)."""
        said = membership.read(self.job_store, live_protocol.worker_of_key(self.node, local_rank))
        worker = None if said is None else live_protocol.WorkerOf.from_json(said)
        return worker.wid if worker is not None and worker.pid == pid else None

    def _kill_hung(self) -> None:
        """Kill the workers that the job's other members took out as hung (they are started again as failed)."""
        for local_rank, slot in self.slots.items():
            worker = slot.process
            if worker is None or worker.pid is None or worker.poll() is not None:
                continue
            try:
                wid = self._worker_id(local_rank, worker.pid)
                hung = wid is not None and \
                    membership.read(self.job_store, live_protocol.dead_key(wid)) == live_protocol.HUNG
            except (RuntimeError, OSError, ValueError) as error:
                logger.debug("could not read whether worker %d was taken out as hung: %s", local_rank, error)
                continue
            if hung:
                logger.warning("adaptive-run --live: the job's other members took worker %d (pid %d) out as hung; "
                               "killing it", local_rank, worker.pid)
                process_tree.kill_process_tree(worker.pid, include_root=True, timeout=5.0)

    def _say_dead(self, local_rank: int, pid: int | None) -> None:
        """Tell the job's other members that this local rank's worker, process ``pid``, died (they stop waiting
        for it)."""
        try:
            wid = self._worker_id(local_rank, pid)
            if wid is not None:
                self.job_store.set(live_protocol.dead_key(wid), "1")
        except (RuntimeError, OSError, ValueError) as error:
            logger.debug("could not report the death of worker %d: %s", local_rank, error)

    def _store_answers(self) -> bool:
        """Whether the job's store answers now (one read)."""
        try:
            self.store.check([live_protocol.AGENTS_KEY])
            return True
        except (RuntimeError, OSError):
            return False

    def _drained(self) -> bool:
        """Whether this node was asked to drain (:mod:`adaptive.runtime.draining`): its workers are not started
        again; False when the store cannot say."""
        try:
            return draining.is_drained(self.job_store, self.node)
        except (RuntimeError, OSError) as error:
            logger.debug("could not read whether node %d was drained: %s", self.node, error)
            return False

    def _exit_status(self) -> int:
        if self._drained():
            logger.warning("adaptive-run --live: node %d was drained; its workers left the job", self.node)
        codes = {slot.exit_code for slot in self.slots.values() if slot.exit_code is not None}
        if codes <= {0}:
            return 0
        return 143 if codes <= set(DONE_EXIT_CODES) else 1

    def _kill_all(self) -> None:
        process_tree.kill_process_tree(os.getpid(), include_root=False, timeout=10.0)

    def release(self) -> None:
        """Leave the job; the hosting agent serves the store while another agent lives.

        An agent lives while it renews its sign of life in the store (a lost
        node's agent stops renewing it and is not waited for).
        """
        try:
            self._beat(done=True)
        except (RuntimeError, OSError) as error:  # the hosting agent is gone with its store: nothing to tell
            logger.debug("could not tell the job's store that node %d is done: %s", self.node, error)
            return
        if not self.hosting or not self._others_alive():
            return
        logger.warning("adaptive-run --live: node %d has no workers left; it keeps serving the job's store until "
                       "the other nodes are done", self.node)
        while self._others_alive():
            time.sleep(0.1)

    def _others_alive(self) -> bool:
        """Whether another agent of the job renewed its sign of life lately (of the :data:`MAX_NODES` newest
        node numbers: a counter raised by someone else costs at most that many reads)."""
        count = int(self.store.add(live_protocol.AGENTS_KEY, 0))
        for node in range(max(1, count - MAX_NODES + 1), count + 1):
            said = None if node == self.node else membership.read(self.agents, live_protocol.agent_key(node))
            if said is not None and said != "done" and time.time() - float(said) < membership.AGENT_STALE:
                return True
        return False


def run(args: Namespace, status_dir: str, warm: WarmStarter | None = None) -> int:
    """``adaptive-run --live ARGS``: run this node's part of a live job; returns the exit status.

    ``warm``: the pre-warmed process when the launcher started it already
    (:func:`~adaptive.elastic.warm_start.start_early`); else it is started
    here, unless ``--cold-start``.
    """
    config = LiveConfig.from_args(args)
    try:
        live_store.warn_if_unsigned(config.host, config.port)  # reads the secret: a bad one ends the launcher here
    except ValueError as error:
        raise SystemExit(f"adaptive-run --live: {error}") from None
    if warm is None and not config.cold_start:
        warm = WarmStarter()  # it imports while the agent joins the job
    if warm is not None:
        warm.preload(list(config.preload))
    try:
        agent = LiveAgent(config, status_dir, warm)
        signal.signal(signal.SIGTERM, agent.stop)
        signal.signal(signal.SIGINT, agent.stop)
        try:
            status = agent.run()
        finally:
            agent.release()
    finally:
        if warm is not None:
            warm.close()
    return status
