"""What vLLM does with a dead API server, and the ipc directories left behind.

vLLM does not restart an API server: when one dies, ``vllm serve`` stops all
of them (``wait_for_completion_or_failure``), and at its default shutdown
(abort, no grace) it SIGKILLs them, so no API server removes the directory
the plugin's routing used. The next ``vllm serve`` with the switch removes
such directories at start, and never one in use.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

from mptok.front.ipc_dir import PREFIX
from mptok_harness.vllm import VllmServer
from mptok_harness.vllm_requests import agent_turns

# A process that joins the ipc dir of a "vllm serve" (a sleeping child of
# its own) as an API server does, then dies by SIGKILL, as vLLM's API
# servers do at shutdown.
_JOIN_AND_DIE = """
import os, signal, subprocess, sys
from mptok.front.ipc_dir import SharedIpcDir
server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
joined = SharedIpcDir(server_pid=server.pid)
print(joined.path, flush=True)
server.kill()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_dead_api_server_stops_vllm_serve_and_its_dir_is_swept_by_the_next_start(model_dir, logs_dir):
    dead = subprocess.run([sys.executable, "-c", _JOIN_AND_DIE], capture_output=True, text=True, timeout=60)
    stale = dead.stdout.strip()
    assert dead.returncode == -signal.SIGKILL and os.path.isdir(stale), dead.stderr
    assert os.path.basename(stale).startswith(PREFIX)

    server = VllmServer(model_dir, logs_dir / "teardown.log", mptok=True)
    with server:
        assert not os.path.exists(stale), "the next vllm serve with the switch removes a dead server's dir"
        live_dirs = [d for d in os.listdir(tempfile.gettempdir()) if d.startswith(f"{PREFIX}{server.process.pid}-")]
        assert len(live_dirs) == 1, live_dirs
        for messages in list(agent_turns(5, 3)):
            server.chat_ids({"messages": messages})
        victim = server.api_server_pids()[1]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while server.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert server.process.poll() is not None, "vllm serve keeps running without one of its API servers"
        assert server.process.returncode != 0
