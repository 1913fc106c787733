"""The cluster half of the GPU device check (python/gpu_cluster_check.py)
run here on host pools: both daemons stage them as they would GPU pools
(KVMESH_TEST_HOOK=stage-host-pools), so the check itself — starting a
two-daemon cluster, a remote fetch through staging slots from Python, the
bytes, verification and the staging counters — is tested without a GPU.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import kvmeshd_binary

SCRIPT = Path(__file__).resolve().parents[1] / "gpu_cluster_check.py"


def test_cluster_check_moves_staged_blocks_between_two_daemons(tmp_path):
    # Run from a copy: next to the source tree's kvmesh/ (no native module)
    # the script would import that one instead of the installed package.
    script = tmp_path / SCRIPT.name
    shutil.copy(SCRIPT, script)
    r = subprocess.run(
        [sys.executable, str(script), "--kvmeshd", kvmeshd_binary(), "--device", "host"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.stdout.strip(), r.stderr[-2000:]
    line = r.stdout.strip().splitlines()[-1]
    res = json.loads(line)
    assert r.returncode == 0 and res["ok"], res
    assert res["check"] == "cluster-staged-host"
    assert res["staged_reads"] == res["blocks"] == 48, res
    assert res["staged_sends"] == 48, res
