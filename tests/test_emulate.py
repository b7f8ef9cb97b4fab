"""Emulated nodes on one host (``distmm.emulate``), on CPU.

Covers: the layout (members to nodes, uneven splits refused with one line, one node a
no-op, the all-links mode) and each node's environment; the ``mpiexec`` MPMD command
(``distmm.cli.emulated``); study series on emulated nodes (``nodes``, ``emulated``) and
``distmm report``'s label; under a real ``mpiexec`` of 4 ranks as 2 nodes, each rank's
node environment checked from inside, its GPU binding still the real host's node-local
rank, and MPI engine products against float64; the batch path (``distmm matmul`` on files)
choosing broadcast across emulated nodes and read on one host (its profile says which);
a real LocalCluster of 4 worker processes as 2 nodes: each worker's environment, the
engine's CUDA IPC pairs only inside a node (the pure decision and the engine's own, in
block mode), and products against float64. The GPU side (NCCL's Socket transport between
nodes) is ``tests/test_emulate_gpu.py``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from distmm.cli.emulated import mpiexec_command
from distmm.cli.study import parse_study
from distmm.emulate import ALL_LINKS, layout, link_host, record_value, this_node

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


# -- the layout, pure -------------------------------------------------------------------------


@pytest.mark.parametrize("members, nodes, expect", [
    (4, 2, [0, 0, 1, 1]), (6, 3, [0, 0, 1, 1, 2, 2]), (8, 2, [0] * 4 + [1] * 4),
    (3, 3, [0, 1, 2]), (5, 1, [0] * 5),
])
def test_members_to_nodes(members, nodes, expect):
    lay = layout(members, nodes)
    assert [lay.node_of(i) for i in range(members)] == expect
    assert [list(lay.members_of(n)) for n in range(nodes)] == [
        [i for i, e in enumerate(expect) if e == n] for n in range(nodes)]
    with pytest.raises(IndexError):
        lay.node_of(members)


@pytest.mark.parametrize("members, nodes, words", [
    (6, 4, "6 members do not split evenly into 4 emulated nodes"),
    (5, 2, "5 members do not split evenly into 2 emulated nodes"),
    (2, 4, "4 emulated nodes need at least 4 members, got 2"),
    (4, 0, "emulated nodes must be a positive integer"),
    (4, "two", "emulated nodes must be a positive integer"),
    (0, 1, "members must be a positive integer"),
])
def test_bad_layouts_are_one_line(members, nodes, words):
    with pytest.raises(ValueError) as info:
        layout(members, nodes)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_one_node_emulates_nothing():
    lay = layout(4, 1)
    assert not lay.active and lay.record_value is None
    assert lay.environment(0) == {} and lay.job_environment() == {}
    assert mpiexec_command(["mpiexec", "--bind-to", "core"], 4, 1, ["prog", "x"]) == [
        "mpiexec", "--bind-to", "core", "-n", "4", "prog", "x"]


def test_node_environment():
    lay = layout(4, 2)
    envs = [lay.environment(n) for n in range(2)]
    assert [e["NCCL_HOSTID"] for e in envs] == ["distmm-emulated-node-0", "distmm-emulated-node-1"]
    for node, env in enumerate(envs):
        assert env["DISTMM_EMULATED_NODE"] == str(node) and env["DISTMM_EMULATED_NODES"] == "2"
        assert (env["NCCL_IB_DISABLE"], env["NCCL_SOCKET_IFNAME"], env["NCCL_NET"]) == (
            "1", "lo", "Socket")
        assert "NCCL_P2P_DISABLE" not in env and "NCCL_SHM_DISABLE" not in env
    assert lay.job_environment() == {"OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,tcp",
                                     "OMPI_MCA_btl_tcp_if_include": "lo"}
    assert lay.record_value == 2


def test_all_links_mode():
    lay = layout(4, ALL_LINKS)
    assert lay.nodes == 4 and lay.per_node == 1 and lay.record_value == ALL_LINKS
    env = lay.environment(3)
    assert env["NCCL_P2P_DISABLE"] == env["NCCL_SHM_DISABLE"] == "1"
    assert "NCCL_HOSTID" not in env and env["DISTMM_EMULATED_NODES"] == ALL_LINKS
    assert record_value(env) == ALL_LINKS


def test_this_node_and_link_host():
    assert this_node({}) is None and this_node({"DISTMM_EMULATED_NODE": " "}) is None
    assert this_node({"DISTMM_EMULATED_NODE": "3"}) == 3
    for bad in ("-1", "x"):
        with pytest.raises(ValueError, match="DISTMM_EMULATED_NODE"):
            this_node({"DISTMM_EMULATED_NODE": bad})
    assert link_host("h", {}) == "h"
    assert link_host("h", {"DISTMM_EMULATED_NODE": "0"}) != link_host(
        "h", {"DISTMM_EMULATED_NODE": "1"})
    assert record_value({}) is None
    assert record_value(layout(4, 2).environment(1)) == 2


def test_mpiexec_command_is_one_context_per_node():
    argv = mpiexec_command(["mpiexec", "--oversubscribe"], 6, 3, ["python", "prog.py"])
    assert argv[:2] == ["mpiexec", "--oversubscribe"]
    contexts = " ".join(argv[2:]).split(" : ")
    assert len(contexts) == 3
    # the job's Open MPI transport once, before the first context
    assert contexts[0].startswith("-x OMPI_MCA_pml=ob1 -x OMPI_MCA_btl=self,tcp")
    for node, ctx in enumerate(contexts):
        words = ctx.split()
        assert words[words.index("-n") + 1] == "2"
        assert f"DISTMM_EMULATED_NODE={node}" in words
        assert f"NCCL_HOSTID=distmm-emulated-node-{node}" in words
        assert words[-2:] == ["python", "prog.py"]
    with pytest.raises(ValueError, match="do not split evenly"):
        mpiexec_command(["mpiexec"], 6, 4, ["prog"])
    with pytest.raises(ValueError, match="the layout has 4 members, the launch 6 ranks"):
        mpiexec_command(["mpiexec"], 6, layout(4, 2), ["prog"])


# -- the Dask engine's decision, pure ---------------------------------------------------------


def test_ipc_pairs_stay_inside_an_emulated_node():
    from distmm.engine.dask.transfer import candidate_pairs
    from distmm.plan_blocks import WorkerInfo

    def worker(port, node):
        return WorkerInfo(f"tcp://127.0.0.1:{port}", 1, True, str(port), 1.0, True, node=node)

    w = [worker(p, p // 2) for p in range(4)]
    pairs = candidate_pairs(w)
    assert pairs == {(w[0].address, w[1].address), (w[1].address, w[0].address),
                     (w[2].address, w[3].address), (w[3].address, w[2].address)}
    # no emulated node: one host, every pair; a CPU worker in none
    plain = [replace(x, node=None) for x in w]
    assert len(candidate_pairs(plain)) == 12
    assert candidate_pairs([w[0], replace(w[1], gpu=False)]) == frozenset()
    # every worker its own node (all-links): none
    assert candidate_pairs([replace(x, node=i) for i, x in enumerate(w)]) == frozenset()


# -- studies and the report -------------------------------------------------------------------

STUDY = {"name": "emu", "device": "cpu", "dtypes": ["float64"], "series": [
    {"kind": "strong", "engines": ["dask", "mpi"], "counts": [4], "sizes": [64], "nodes": 2,
     "emulated": True}]}


def _series(**extra):
    return {**STUDY, "series": [{**STUDY["series"][0], **extra}]}


def test_study_series_on_emulated_nodes():
    configs = parse_study(STUDY).configurations()
    assert {c.variant for c in configs} == {"distmm-dask-emulated-2nodes@4workers",
                                            "distmm-mpi-emulated-2nodes@4ranks"}
    assert {c.nodes for c in configs} == {2}
    crude = parse_study(_series(nodes=None, emulated=ALL_LINKS)).configurations()
    assert {c.nodes for c in crude} == {ALL_LINKS}
    assert "distmm-mpi-emulated-all-links@4ranks" in {c.variant for c in crude}
    # a plain series beside it is measured apart
    both = parse_study({**STUDY, "series": STUDY["series"] + [
        {"kind": "strong", "engines": ["mpi"], "counts": [4], "sizes": [64]}]})
    assert {c.place for c in both.configurations()} == {("dask", 4, 2), ("mpi", 4, 2),
                                                        ("mpi", 4, None)}


@pytest.mark.parametrize("extra, words", [
    ({"emulated": False}, "series[0].nodes: the runner runs on one host: set emulated = true"),
    ({"nodes": 3}, "series[0].counts: 4 does not split evenly into 3 emulated nodes"),
    ({"nodes": 1}, "series[0].nodes: emulated = true needs nodes = 2 or more"),
    ({"emulated": "yes"}, "series[0].emulated: true, false or \"all-links\""),
    ({"emulated": ALL_LINKS}, "series[0].nodes: emulated = \"all-links\" makes every device"),
    ({"engines": ["local"]}, "series[0].emulated: the local engine runs in one process"),
])
def test_bad_emulated_series_is_one_line(extra, words):
    data = _series(**extra)
    data["series"][0] = {k: v for k, v in data["series"][0].items() if v is not None}
    with pytest.raises(ValueError) as info:
        parse_study(data, where="s.toml")
    assert str(info.value).startswith(f"s.toml: {words}") and "\n" not in str(info.value)


def test_report_labels_emulated_series():
    from distmm.cli.report import emulated_label, scaling

    recs = [dict(run="r", benchmark="b", variant=f"distmm-mpi{tag}@{p}ranks", device="d",
                 dtype="float64", m=64, n=64, k=64, seconds=4.0 / p, ranks=p, **extra)
            for p in (2, 4) for tag, extra in (("", {}), ("-emulated-2nodes",
                                                          {"emulated_nodes": 2}))]
    families = sorted(s.family for s in scaling(recs, "strong"))
    assert families == ["distmm-mpi", "distmm-mpi-emulated-2nodes [emulated nodes: 2]"]
    assert emulated_label({"emulated_nodes": ALL_LINKS}) == " [emulated nodes: all-links]"


# -- MPI: 4 ranks as 2 emulated nodes, real mpiexec -------------------------------------------


@pytest.fixture
def emulated_run(mpiexec, mpi_env):
    """``emulated_run(ranks, nodes, *program, timeout=180)``: ``program`` (after
    ``python``) under ``mpiexec_command``, finished, its output captured."""
    def run(ranks, nodes, *program, timeout=180, env=None):
        argv = mpiexec_command([mpiexec, "--oversubscribe"], ranks, nodes,
                               [sys.executable, *map(str, program)])
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              env={**mpi_env, "NUMBA_NUM_THREADS": "1", **(env or {})},
                              cwd=HERE)
    return run


@pytest.mark.mpi
def test_ranks_get_their_node_and_products_are_right(emulated_run):
    r = emulated_run(4, 2, HERE / "mpi_emulate_cases.py", 2)
    assert r.returncode == 0 and "VERDICT ok" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.mpi
def test_batch_path_broadcasts_across_emulated_nodes(tmp_path, emulated_run):
    rng = np.random.default_rng()
    m, k, n = 53, 41, 47
    a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    decided = {}
    for nodes in (2, 1):
        out, prof = tmp_path / f"c{nodes}.npy", tmp_path / f"p{nodes}.json"
        r = emulated_run(4, nodes, "-m", "distmm", "matmul", tmp_path / "a.npy",
                         tmp_path / "b.npy", "-o", out, "--profile", prof)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        np.testing.assert_allclose(np.load(out), a @ b, rtol=1e-12, atol=1e-12)
        meta = json.loads(prof.read_text())["meta"]
        decided[nodes] = (meta["batch_panels"], meta["emulated_nodes"])
    assert decided == {2: ("broadcast", 2), 1: ("read", None)}


# -- Dask: 4 worker processes as 2 emulated nodes ---------------------------------------------


@pytest.fixture(scope="module")
def emulated_client():
    """A LocalCluster of 4 single-thread workers as 2 emulated nodes, GPU by their resource
    only (no device visible: their GPU tasks run the CPU executor)."""
    distributed = pytest.importorskip("distributed")
    from distmm.cli.cluster import cpu_cluster

    with cpu_cluster(4, nodes=2, memory_limit="1GiB", resources={"GPU": 1},
                     env={"CUDA_VISIBLE_DEVICES": ""}) as cl, distributed.Client(cl) as c:
        c.wait_for_workers(4, timeout=120)
        yield c


def _workers(client):
    info = client.scheduler_info(n_workers=-1)["workers"]
    return {a: w["name"] for a, w in info.items()}


def test_workers_carry_their_node(emulated_client):
    got = emulated_client.run(lambda: (os.environ.get("DISTMM_EMULATED_NODE"),
                                       os.environ.get("CUDA_VISIBLE_DEVICES")))
    names = _workers(emulated_client)
    assert sorted(names.values()) == ["node0-w0", "node0-w1", "node1-w2", "node1-w3"]
    for address, (node, visible) in got.items():
        assert names[address].startswith(f"node{node}-") and visible == ""


def test_engine_moves_device_chunks_by_ipc_only_inside_a_node(emulated_client):
    import dask
    import dask.array as da
    import distributed

    import distmm
    from distmm.engine.dask import last_stats, transfer
    from distmm.engine.dask.workers import worker_info
    from conftest import equal_gpus

    names = _workers(emulated_client)
    node = {a: int(n[4]) for a, n in names.items()}
    infos = worker_info(emulated_client)
    assert {w.address: w.node for w in infos} == node and all(w.gpu for w in infos)
    inside = {(x, y) for x in node for y in node if x != y and node[x] == node[y]}
    assert transfer.candidate_pairs(infos) == inside
    rng = np.random.default_rng()
    a, b = rng.standard_normal((211, 97)), rng.standard_normal((97, 150))
    A = emulated_client.persist(da.from_array(a, chunks=(53, 49)))
    B = emulated_client.persist(da.from_array(b, chunks=(49, 38)))
    distributed.wait([A, B])  # the engine reads where the chunks are
    with equal_gpus(), dask.config.set({"distmm.dask-device-transfer": "ipc",
                                        transfer.DEVICE_CHUNKS_KEY: True}):
        got = distmm.matmul(A, B, client=emulated_client).compute()
    pairs = {tuple(p) for p in last_stats()["transfer"]["pairs"]}
    assert pairs == inside and len(pairs) == 4
    np.testing.assert_allclose(got, a @ b, rtol=1e-12, atol=1e-12)


def test_engine_products_on_emulated_nodes(emulated_client):
    import dask.array as da

    import distmm

    rng = np.random.default_rng()
    for m, k, n in [(67, 45, 51), (128, 33, 90)]:
        a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
        A, B = da.from_array(a, chunks=(32, 17)), da.from_array(b, chunks=(17, 29))
        got = distmm.matmul(A, B, client=emulated_client).compute()
        np.testing.assert_allclose(got, a @ b, rtol=1e-12, atol=1e-12)
        eager = distmm.matmul(a, b, engine="dask", client=emulated_client)
        np.testing.assert_allclose(np.asarray(eager), a @ b, rtol=1e-12, atol=1e-12)


# -- the study runner, end to end -------------------------------------------------------------

EMULATED_STUDY = """
name = "emu-test"
device = "cpu"
dtypes = ["float64"]
repeats = 1
check_rows = 0
references = ["numpy"]
mpiexec = ["mpiexec", "--oversubscribe"]
threads_per_rank = 1
oversubscribe = true

[[series]]
kind = "strong"
engines = ["dask", "mpi"]
counts = [4]
sizes = [[67, 45, 51]]
chunk = 32
nodes = 2
emulated = true

[[series]]
kind = "strong"
engines = ["mpi"]
counts = [4]
sizes = [[67, 45, 51]]
"""


@pytest.mark.slow
@pytest.mark.mpi
def test_emulated_study_end_to_end_then_report(tmp_path, mpi_env):
    """``distmm bench`` on a series of 4 as 2 emulated nodes (a Dask cluster and an MPMD
    launch) beside a plain one: records carry ``emulated_nodes`` and the report says so."""
    study = tmp_path / "emu.toml"
    study.write_text(EMULATED_STUDY)
    out = tmp_path / "records.jsonl"
    env = {**mpi_env, "NUMBA_NUM_THREADS": "1"}

    def distmm_cli(*argv):
        return subprocess.run([sys.executable, "-m", "distmm", *map(str, argv)],
                              capture_output=True, text=True, timeout=300, env=env)

    dry = distmm_cli("bench", study, "--dry-run")
    assert dry.returncode == 0 and "as 2 emulated nodes" in dry.stdout, dry.stderr
    assert "-x DISTMM_EMULATED_NODE=1" in dry.stdout
    r = distmm_cli("bench", study, "-o", out)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    records = {rec["variant"]: rec for rec in map(json.loads, out.read_text().splitlines())}
    assert set(records) == {"numpy", "distmm-dask-emulated-2nodes@4workers",
                            "distmm-mpi-emulated-2nodes@4ranks", "distmm-mpi@4ranks"}
    for variant, rec in records.items():
        assert rec["relerr_ok"] is True and rec["relerr"] < 1e-14, rec
        assert rec.get("emulated_nodes") == (2 if "emulated" in variant else None), rec
    pytest.importorskip("matplotlib")
    report = tmp_path / "report"
    res = distmm_cli("report", out, "-o", report)
    assert res.returncode == 0, res.stderr
    md = (report / "report.md").read_text()
    assert "distmm-mpi-emulated-2nodes@4ranks [emulated nodes: 2]" in md
    assert "| distmm-mpi@4ranks |" in md
