"""The proof that NCCL settings reach every worker (eaglet/dist): workers apply `--nccl-env` before
their communicator exists and report the environment at its creation; a setting applied only
afterwards (the trap of the case eaglet starts from) is reported as not in effect; NCCL's debug
lines are parsed for what it read and the transports it chose. On CPUs with gloo here."""
import json
from pathlib import Path

import pytest

from eaglet.cli import main
from eaglet.dist.nccl import NcclLog, RankReport, check, notes, parse_env_args, parse_log, table
from eaglet.dist.workers import env_reports
from eaglet.errors import InvalidInput

# lines as NCCL 2.2x writes them with NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,ENV
LOG = """\
h200:4685:4685 [0] NCCL INFO Bootstrap : Using eth0:172.21.0.2<0>
h200:4685:4685 [0] NCCL INFO NCCL_PROTO set by environment to LL
h200:4685:4685 [0] NCCL INFO NCCL_ALGO set by environment to Ring
NCCL version 2.27.3+cuda12.9
h200:4685:4702 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC/read
h200:4685:4702 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/IPC/read
h200:4685:4702 [0] NCCL INFO Channel 00/0 : 1[1] -> 0[0] [send] via NET/Socket/3
h200:4685:4702 [0] NCCL INFO comm 0x5a0ca40 rank 0 nranks 2 cudaDev 0 nvmlDev 0 busId 18000 - Init COMPLETE
"""


# the forms of the same lines in older NCCL (2.7 to 2.11): channels without "/0", shared memory
OLDER = """\
node7:2201:2230 [1] NCCL INFO NCCL_P2P_LEVEL set by environment to LOC
node7:2201:2230 [1] NCCL INFO Channel 00 : 1[89000] -> 0[3d000] via direct shared memory
node7:2201:2230 [1] NCCL INFO Channel 01 : 1[89000] -> 2[b1000] via SHM/direct/direct
node7:2201:2230 [1] NCCL INFO Channel 00/0 : 1[89000] -> 3[da000] via P2P/direct pointer
"""


def test_nccl_debug_lines_parse():
    log = parse_log(LOG)
    assert log.version == "2.27.3+cuda12.9"
    assert log.settings == {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring"}
    assert log.transports == {"0->1": "P2P", "1->0": "NET"} and log.ranks == 2
    old = parse_log(OLDER)
    assert old.settings == {"NCCL_P2P_LEVEL": "LOC"}
    assert old.transports == {"1->0": "SHM", "1->2": "SHM", "1->3": "P2P"}


def test_nccl_env_arguments():
    assert parse_env_args(["NCCL_PROTO=LL", "TORCH_NCCL_BLOCKING_WAIT=1"]) == {
        "NCCL_PROTO": "LL", "TORCH_NCCL_BLOCKING_WAIT": "1"}
    for bad, said in (("NCCL_PROTO", "expected KEY=VALUE"), ("CUDA_VISIBLE_DEVICES=0", "not an NCCL setting")):
        with pytest.raises(InvalidInput, match=said):
            parse_env_args([bad])


def test_settings_reach_every_worker_at_communicator_creation():
    """Two gloo workers: the requested setting in each one's environment when its communicator was
    created, nothing to report."""
    reports = env_reports(2, "cpu", {"NCCL_PROTO": "LL"})
    assert [r.rank for r in reports] == [0, 1]
    assert all(r.env_at_creation["NCCL_PROTO"] == "LL" and r.backend == "gloo" for r in reports)
    assert check({"NCCL_PROTO": "LL"}, reports) == []


def test_a_setting_applied_after_the_communicator_is_not_in_effect():
    """The trap: a value put into each worker's environment only after its communicator exists is
    there when asked afterwards (as /proc or a late print would show) but was not when NCCL read
    its settings; eaglet names it, rank by rank."""
    reports = env_reports(2, "cpu", {}, late={"NCCL_ALGO": "Ring"})
    assert all(r.env_now["NCCL_ALGO"] == "Ring" and "NCCL_ALGO" not in r.env_at_creation for r in reports)
    errors = check({"NCCL_ALGO": "Ring"}, reports)
    assert len(errors) == 2 and all("set only afterwards: not in effect" in e for e in errors)
    assert "rank 0" in errors[0] and "rank 1" in errors[1]


def test_ranks_that_disagree_or_nccl_that_did_not_read_a_setting():
    a = RankReport(0, "nccl", {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring"}, {}, "2.27.3", parse_log(LOG))
    b = RankReport(1, "nccl", {"NCCL_PROTO": "LL", "NCCL_ALGO": "Tree"}, {}, "2.27.3", NcclLog(settings={"NCCL_PROTO": "LL"}))
    errors = check({"NCCL_PROTO": "LL"}, [a, b])
    assert errors == ["ranks disagree on NCCL_ALGO: rank 0: Ring, rank 1: Tree"]
    errors = check({"NCCL_ALGO": "Ring"}, [a, b])
    assert any("rank 1 had NCCL_ALGO=Tree" in e for e in errors)
    c = RankReport(1, "nccl", {"NCCL_PROTO": "LL"}, {}, "2.27.3", NcclLog())
    assert check({"NCCL_PROTO": "LL"}, [c]) == [
        "NCCL_PROTO=LL requested, but NCCL on rank 1 did not report reading it (its log: nothing)"]
    text = table([a, b])
    assert "LL (NCCL: LL)" in text and "transport 0->1" in text and "P2P" in text


def test_eaglet_env_command(capsys):
    assert main(["env", "--json"]) == 0
    assert "torch" in json.dumps(json.loads(capsys.readouterr().out))
    assert main(["env", "--tp", "2", "--device", "cpu", "--nccl-env", "NCCL_PROTO=LL", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["errors"] == [] and [r["env_at_creation"]["NCCL_PROTO"] for r in out["ranks"]] == ["LL", "LL"]
    assert main(["env", "--tp", "2", "--device", "cpu", "--nccl-env", "PROTO=LL"]) == 1
    assert "not an NCCL setting" in capsys.readouterr().err


def test_nccl_log_of_one_rank_on_the_h200():
    """NCCL 2.28.9's own log of a one-rank communicator (`bash bench/gpu/nccl.sh` on the H200, asked
    for NCCL_PROTO=LL NCCL_ALGO=Ring with NCCL_NVLS_ENABLE=0 inherited): its version, the rank count,
    the setting it read ("... set by environment to 0." ends with a period), and no algorithm or
    protocol line, since one rank has no peer to tune for. Those two are notes, not errors; a
    setting it did read with another value stays an error."""
    text = (Path(__file__).parent / "data" / "nccl-2.28.9-h200-one-rank.log").read_text()
    log = parse_log(text)
    assert (log.version, log.ranks, log.settings, log.transports) == ("2.28.9+cuda13.0", 1, {"NCCL_NVLS_ENABLE": "0"}, {})
    want = {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring", "NCCL_NVLS_ENABLE": "0"}
    r = RankReport(0, "nccl", dict(want), {}, "2.28.9", log)
    assert check(want, [r]) == []
    said = notes(want, [r])
    assert len(said) == 2 and all("one-rank communicator runs no collective algorithm" in n for n in said)
    assert "NCCL_PROTO=LL" in said[0] and "NCCL_ALGO=Ring" in said[1]
    r.env_at_creation["NCCL_NVLS_ENABLE"] = "1"
    assert check({"NCCL_NVLS_ENABLE": "1"}, [r]) == ["NCCL_NVLS_ENABLE=1 requested, but NCCL on rank 0 read 0"]
    two = RankReport(0, "nccl", {"NCCL_PROTO": "LL"}, {}, "2.27.3", parse_log(LOG.replace("NCCL_PROTO", "NCCL_X")))
    assert check({"NCCL_PROTO": "LL"}, [two])[0].startswith("NCCL_PROTO=LL requested, but NCCL on rank 0 did not")
