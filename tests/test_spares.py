"""The supervisor's warm spares, with a kind of process that only stands by (``mptok_harness.standby``).

``mptok render``'s tests run them with vLLM, in minutes; here the same
supervisor paths run in seconds: spares started once every slot is ready,
a slot's exit taken over by a warm spare (and the spare replaced), a spare's
own exit, and the stop of every slot and spare.
"""

from __future__ import annotations

import os
import re
import signal
import sys

from mptok.supervise.snapshots import SUPERVISOR_SNAPSHOT, SnapshotDir
from mptok_harness.checks import wait_until
from mptok_harness.serve import Server

COMMAND = (sys.executable, "-m", "mptok_harness.standby")


def _spares_ready(server: Server) -> int:
    return SnapshotDir(server.ipc_dir()).read_all().get(SUPERVISOR_SNAPSHOT, {}).get("spares", 0)


def test_a_warm_spare_takes_an_exited_slot_and_is_replaced(tmp_path):
    with Server(tmp_path / "standby.log", "--frontends", "2", "--spares", "1", command=COMMAND) as server:
        spare = int(server.wait_for_log(r"event=spare_ready pid=(\d+) after_s=").group(1))
        wait_until(lambda: _spares_ready(server) == 1, "the supervisor's snapshot counting the spare", 30)
        old = server.frontend_pids()[0]
        offset = len(server.log())
        os.kill(old, signal.SIGKILL)
        server.wait_for_log(rf"level=ERROR .*event=frontend_exited frontend=0 pid={old} exit=\"signal SIGKILL\"", after=offset)
        server.wait_for_log(rf'event=frontend_started frontend=0 pid={spare} restarts=1 start="warm spare"', after=offset)
        server.wait_for_log(rf"event=frontend_ready frontend=0 pid={spare} restarts=1", after=offset)
        # Its replacement is started behind it, and stands by in turn.
        new_spare = int(server.wait_for_log(r"event=spare_started pid=(\d+)", after=offset).group(1))
        server.wait_for_log(rf"event=spare_ready pid={new_spare} ", after=offset)
        assert server.frontend_pids() == {0: spare, 1: server.frontend_pids()[1]}

        # A spare that exits is replaced after a back-off.
        offset = len(server.log())
        os.kill(new_spare, signal.SIGKILL)
        server.wait_for_log(rf"level=ERROR .*event=spare_exited pid={new_spare} exit=\"signal SIGKILL\" .*restart_in_s=", after=offset)
        third = int(server.wait_for_log(r"event=spare_started pid=(\d+)", after=offset).group(1))
        server.wait_for_log(rf"event=spare_ready pid={third} ", after=offset)

        offset = len(server.log())
        server.process.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0
        log = server.log()[offset:]
        assert re.search(rf"event=frontend_stopped frontend=spare pid={third} exit=\"code 0\"", log), log
        for frontend in (0, 1):
            assert re.search(rf"event=frontend_stopped frontend={frontend} pid=\d+ exit=\"code 0\"", log), log
        assert "event=stopped" in log


def test_a_slot_started_without_spares_stands_by_then_serves(tmp_path):
    with Server(tmp_path / "standby.log", "--frontends", "1", "--spares", "0", command=COMMAND) as server:
        old = server.frontend_pids()[0]
        offset = len(server.log())
        os.kill(old, signal.SIGKILL)
        started = server.wait_for_log(r'event=frontend_started frontend=0 pid=(\d+) restarts=1 start="new process"', after=offset)
        server.wait_for_log(rf"event=frontend_ready frontend=0 pid={started.group(1)} restarts=1", after=offset)
        assert "spare_started" not in server.log()


def test_a_spare_still_starting_takes_a_slot_and_gets_the_rest_of_its_start_up_time(tmp_path):
    args = ("--frontends", "1", "--spares", "1", "--standby-after", "3")
    with Server(tmp_path / "standby.log", *args, command=COMMAND) as server:
        spare = int(server.wait_for_log(r"event=spare_started pid=(\d+)").group(1))
        offset = len(server.log())
        os.kill(server.frontend_pids()[0], signal.SIGKILL)
        server.wait_for_log(rf'event=frontend_started frontend=0 pid={spare} restarts=1 start="spare still starting"', after=offset)
        server.wait_for_log(rf"event=frontend_ready frontend=0 pid={spare} restarts=1", after=offset)
        assert "spare_ready" not in server.log()[offset:]  # it stood by as the slot's process, not as a spare


def test_spares_that_crash_loop_pause_for_the_given_up_retry(tmp_path):
    args = ("--frontends", "1", "--spares", "1", "--max-restarts", "0", "--given-up-retry", "1")
    with Server(tmp_path / "standby.log", *args, command=COMMAND) as server:
        spare = int(server.wait_for_log(r"event=spare_ready pid=(\d+)").group(1))
        offset = len(server.log())
        os.kill(spare, signal.SIGKILL)
        server.wait_for_log(
            rf'level=CRITICAL .*event=spares_paused pid={spare} exit="signal SIGKILL" .*reason="spares crash loop: '
            r'more than --max-restarts 0 exits within 60 s" action="no spares for 1 s \(--given-up-retry\)',
            after=offset,
        )
        again = int(server.wait_for_log(r"event=spare_started pid=(\d+)", after=offset).group(1))
        server.wait_for_log(rf"event=spare_ready pid={again} ", after=offset)
        assert server.frontend_pids()[0] != spare
