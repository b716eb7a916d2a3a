"""`offspec batch --workers N`: the job sharded over Ray actors, on a local Ray with 2 CPUs and tiny models.

One Ray for the whole module (its start costs seconds); the CLI joins it with --ray-address, as it would join a
cluster. Checked: 2 workers == 1 worker == no Ray, token for token (greedy, float32), every prompt exactly once;
one worker's feed topped up as prompts finish (one run for the whole job); a worker's process killed while
it runs (the prompts given to it go back to the queue, Ray restarts it); the driver killed with
SIGKILL, then the same command resumes; --workers without Ray, and a job the cluster cannot place, in one line."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ray = pytest.importorskip("ray", reason="the Ray tests need ray (pip install -e .[test])")

from test_cli import FAST, cli, ok, printable_only, read_results, write_jsonl
from tiny import hf_config, make_model, perturbed_copy, save_checkpoint

from offspec.config import OffloadConfig, RunLimits, RuntimeConfig, TreeConfig
from offspec.engine.generate import GenerationRequest
from offspec.engine.prompt import encode_prompt
from offspec.formats.open import load_tokenizer
from offspec.jobs.cluster import LOCAL_OBJECT_STORE, Cluster, WorkerSpec
from offspec.jobs.runner import PromptDone
from offspec.plan.search import AUTO_CONCURRENCY

REPO = Path(__file__).resolve().parents[1]
RUNTIME = RuntimeConfig(device=torch.device("cpu"), dtype=torch.float32)
N_PROMPTS = 12
NEW_TOKENS = 48               # enough passes that a worker is still busy when the test kills something
TREE = ["--tree-budget", "8"]  # a fixed budget: every run draws the same trees


@pytest.fixture(scope="module")
def ray_address():
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=LOCAL_OBJECT_STORE, logging_level="ERROR")
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def m(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    target = printable_only(make_model(hf_config("qwen2", n_layers=2), seed=7, scale=3.0))
    t = save_checkpoint(target, root / "target")
    d = save_checkpoint(printable_only(perturbed_copy(target, noise=0.02)), root / "draft")
    prompts = write_jsonl(root / "p.jsonl", [{"id": f"p{i}", "prompt": f"prompt {i}: " + "why? " * (i % 4),
                                              "max_new_tokens": NEW_TOKENS - i % 3} for i in range(N_PROMPTS)])
    local = root / "local.jsonl"                               # the reference: one engine, no Ray
    threads = torch.get_num_threads()
    torch.set_num_threads(1)         # as a worker runs (--worker-cpus 1): two threads on a busy 2-core machine wait
    try:                             # on each other (measured here: 27 s instead of 1.5 s for these prompts)
        ok(cli("batch", prompts, "-o", local, "--target", t, "--draft", d, *FAST, *TREE, "--concurrency", 2))
    finally:
        torch.set_num_threads(threads)
    return SimpleNamespace(root=root, target=t, draft=d, prompts=prompts, models=["--target", t, "--draft", d],
                           reference={r["id"]: r["tokens"] for r in read_results(local)})


def worker_processes() -> list[int]:
    """Pids of live worker actors: Ray titles an actor's process ray::<class>[.<method>]."""
    import psutil

    pids = []
    for process in psutil.process_iter(["cmdline", "status"]):
        cmdline = process.info["cmdline"] or [""]
        if cmdline[0].startswith("ray::BatchWorker") and process.info["status"] != psutil.STATUS_ZOMBIE:
            pids.append(process.pid)
    return pids


def tokens_by_id(path) -> dict:
    rows = read_results(path)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), f"an id written twice: {ids}"
    return {r["id"]: r["tokens"] for r in rows}


def test_workers_without_ray_say_so_in_one_line(m, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)              # `import ray` fails as if it were not installed
    result = cli("batch", m.prompts, "-o", tmp_path / "o.jsonl", *m.models, *FAST, "--workers", 2)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stderr.strip().splitlines() == [
        "offspec: error: --workers runs the job on Ray, which is not installed here: pip install 'ray>=2.40' "
        "(from a checkout: pip install -e '.[ray]')"]
    assert not (tmp_path / "o.jsonl").exists()
    result = cli("batch", m.prompts, "-o", tmp_path / "o.jsonl", *m.models, *FAST, "--ray-address", "auto")
    assert result.exit_code == 1 and result.stderr.strip() == "offspec: error: --ray-address needs --workers"


def test_more_workers_than_the_cluster_can_place_is_one_line(m, ray_address, tmp_path):
    result = cli("batch", m.prompts, "-o", tmp_path / "o.jsonl", *m.models, *FAST, "--workers", 3,
                 "--ray-address", ray_address)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stderr.strip().splitlines()[-1] == ("offspec: error: --workers 3 × --worker-cpus 1 needs 3 CPUs; "
                                                      "the cluster has 2")


@pytest.mark.parametrize("workers,concurrency", [(1, "auto"), (2, "2")])
def test_workers_give_the_tokens_of_one_engine_each_prompt_once(m, ray_address, tmp_path, workers, concurrency):
    """auto: the concurrency the worker's memory plan fits (made for the machine the probe task measured)."""
    out, job = tmp_path / "out.jsonl", tmp_path / "job.json"
    result = ok(cli("batch", m.prompts, "-o", out, *m.models, *FAST, *TREE, "--concurrency", concurrency,
                    "--workers", workers, "--ray-address", ray_address, "--json", job))
    assert tokens_by_id(out) == m.reference
    report = json.loads(job.read_text())
    assert report["prompts"] == N_PROMPTS and len(report["workers"]) == workers
    assert sum(w["prompts"] for w in report["workers"]) == N_PROMPTS
    assert sum(w["generated_tokens"] for w in report["workers"]) == report["generated_tokens"] > 0
    assert all(w["tokens_per_second"] > 0 and w["restarts"] == 0 for w in report["workers"] if w["prompts"])
    assert report["concurrency"] == (min(AUTO_CONCURRENCY, N_PROMPTS) if concurrency == "auto" else 2)
    assert f"ray: {workers} workers on cpu" in result.stderr and "worker 0 (" in result.stderr
    assert "nothing to do" in ok(cli("batch", m.prompts, "-o", out, *m.models, *FAST, *TREE, "--workers", workers,
                                     "--ray-address", ray_address)).stderr


def test_a_prompt_a_worker_refuses_is_skipped_in_one_line(m, ray_address, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "long", "prompt": "x" * 600},   # over the 512-token context
                                                 {"id": "short", "prompt": "prompt 0: ", "max_new_tokens": 5}])
    out = tmp_path / "out.jsonl"
    result = ok(cli("batch", prompts, "-o", out, *m.models, *FAST, *TREE, "--context", 512, "--workers", 1,
                    "--ray-address", ray_address))
    assert [r["id"] for r in read_results(out)] == ["short"]
    assert "line 1 (id long)" in result.stderr and "context holds only 512" in result.stderr
    assert "skipped 1 bad" in result.stderr


def job(m, concurrency):
    """The prompts as GenerationRequests (in file order) and a worker spec of `concurrency` rows."""
    tokenizer, tree = load_tokenizer(m.target), TreeConfig(budget=8)
    rows = [json.loads(line) for line in m.prompts.read_text().splitlines()]
    requests = [GenerationRequest(prompt_ids=tuple(encode_prompt(tokenizer, r["prompt"])),
                                  max_new_tokens=r["max_new_tokens"], tree=tree) for r in rows]
    spec = WorkerSpec(target=str(m.target), draft=str(m.draft), demo=False, offload=OffloadConfig(), runtime=RUNTIME,
                      limits=RunLimits(context=256, tree_budget=8, sampling=False, concurrency=concurrency),
                      prefill_per_pass=None, cpus=1)
    return rows, requests, spec


def test_one_worker_runs_the_whole_job_in_one_run_its_feed_topped_up(m, ray_address):
    """The driver keeps the worker's feed at twice its rows and puts a prompt in each time one comes back, so
    the 12 prompts go through ONE run_batch (no pause between hand-outs with rows draining) and the run ends
    when the driver closes the emptied queue's feed."""
    rows, requests, spec = job(m, concurrency=2)
    with Cluster(ray) as cluster:
        cluster.start(spec, 1, host_bytes=1 << 30)
        got = {}
        for event in cluster.run(requests, concurrency=2):
            assert isinstance(event, PromptDone) and event.request not in got
            got[event.request] = event.report.tokens
        worker = cluster.workers[0]
        assert worker.run == 1 and worker.run_given == N_PROMPTS and worker.given == [] and worker.closed
    assert [got[i] for i in range(N_PROMPTS)] == [m.reference[r["id"]] for r in rows]


def test_a_worker_killed_while_it_runs_loses_and_duplicates_nothing(m, ray_address):
    """os.kill(SIGKILL) on a worker's process while it runs: the prompts given to it and not yet received go
    back to the queue, Ray restarts the process, and every prompt still comes back exactly once with the
    tokens of one engine."""
    rows, requests, spec = job(m, concurrency=1)
    notes = []
    with Cluster(ray, notify=notes.append) as cluster:
        cluster.start(spec, 2, host_bytes=1 << 30)
        workers = list(cluster.workers)
        got, victim = {}, None
        for event in cluster.run(requests, concurrency=1):
            assert isinstance(event, PromptDone) and event.request not in got
            got[event.request] = event.report.tokens
            if victim is None:            # the first prompt back: kill a worker that still has prompts to run
                victim = next(w for w in cluster.workers if w.given and w.report.pid is not None)
                victim_pid, unfinished = victim.report.pid, len(victim.given)
                os.kill(victim_pid, signal.SIGKILL)
    assert [got[i] for i in range(N_PROMPTS)] == [m.reference[r["id"]] for r in rows]
    assert victim.report.restarts == 1 and 1 <= victim.report.requeued <= unfinished
    assert any(f"pid {victim_pid}) died" in note for note in notes)
    assert sum(w.report.prompts for w in workers) == N_PROMPTS


def test_the_driver_killed_then_the_same_command_resumes(m, ray_address, tmp_path):
    """SIGKILL on the `offspec batch --workers 2` process once two lines are written: the lines stay complete,
    Ray ends the dead driver's worker processes, and the same command writes exactly the missing prompts."""
    out = tmp_path / "out.jsonl"
    args = ["batch", m.prompts, "-o", out, *m.models, *FAST, *TREE, "--concurrency", 1, "--workers", 2,
            "--ray-address", ray_address]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with open(tmp_path / "driver.log", "w") as log:
        driver = subprocess.Popen([sys.executable, "-m", "offspec.cli", *map(str, args)], cwd=REPO, env=env,
                                  stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and driver.poll() is None:
                if out.exists() and out.read_text().count("\n") >= 2:
                    break
                time.sleep(0.02)
            driver.send_signal(signal.SIGKILL)
        finally:
            driver.kill()
            driver.wait()
    before = tokens_by_id(out)
    assert 2 <= len(before) < N_PROMPTS, (len(before), (tmp_path / "driver.log").read_text()[-2000:])
    deadline = time.monotonic() + 30                # Ray ends the dead driver's workers (they belong to its job)
    while worker_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert worker_processes() == []

    result = ok(cli(*args))
    assert f"resuming: {len(before)} of {N_PROMPTS}" in result.stderr
    assert tokens_by_id(out) == m.reference


def test_workers_on_one_node_build_a_disk_store_once(m, tmp_path, monkeypatch):
    """Two workers loading at once with --offload disk and no store yet: the node lock lets the first build it
    and the second open it (without the lock both would see no store and write the same files)."""
    import threading

    import offspec.engine.load
    from offspec.jobs.cluster import BatchWorker

    builds, real_prepare = [], offspec.engine.load.prepare_disk_store

    def counted_prepare(*args, **kwargs):
        builds.append(threading.current_thread().name)
        time.sleep(0.5)                          # a build long enough for the other worker to arrive meanwhile
        return real_prepare(*args, **kwargs)
    monkeypatch.setattr(offspec.engine.load, "prepare_disk_store", counted_prepare)
    monkeypatch.setenv("OFFSPEC_HOME", str(tmp_path / "home"))
    spec = WorkerSpec(target=str(m.target), draft=None, demo=False,
                      offload=OffloadConfig(mode="disk", store_dir=str(tmp_path / "store")), runtime=RUNTIME,
                      limits=RunLimits(context=64, tree_budget=0, sampling=False), prefill_per_pass=None,
                      cpus=torch.get_num_threads())
    workers = [BatchWorker(spec) for _ in range(2)]
    infos, errors = [], []

    def load(worker):
        try:
            infos.append(worker.load())
        except Exception as e:                   # noqa: BLE001 - reported by the assertion below
            errors.append(e)
    threads = [threading.Thread(target=load, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert errors == [] and len(infos) == 2 and len(builds) == 1
        assert all("streamed from the disk store" in info.layers_line for info in infos)
    finally:
        for worker in workers:
            if worker.loaded is not None:
                worker.loaded.engine.close()
