"""scripts/bench_peers.py and scripts/render_peers.py end to end on tiny checkpoints (CPU, float32, seconds):
offspec loads through the memory plan, every system runs on every prompt, greedy outputs all equal plain
greedy's, the rows file resumes and refuses other settings, and the tables render from the rows alone."""
import json

import pytest

from scripts_module import load_script
from tiny import hf_config, make_model, make_tokenizer, perturbed_copy, save_checkpoint

SYSTEMS = "hf-assisted,hf-plain,default,none,chain-3,dyspec-4"


@pytest.fixture(scope="module")
def bp():
    return load_script("bench_peers")


@pytest.fixture(scope="module")
def render():
    return load_script("render_peers")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("peers")
    target = make_model(hf_config("llama", n_layers=3), scale=4.0)
    draft = perturbed_copy(target, noise=0.01)
    tok = make_tokenizer()
    return save_checkpoint(target, root / "target", tok), save_checkpoint(draft, root / "draft", tok)


def run(bp, checkpoints, rows, *extra):
    """bench_peers on the tiny pair, float32 and every system unless `extra` says otherwise (later options win)."""
    target, draft = checkpoints
    return bp.main(["--regime", "cpu", "--prompt-set", "chat", "--prompts", "2", "--new-tokens", "6", "--dtype",
                    "float32", "--device", "cpu", "--systems", SYSTEMS, "--assist-defaults", "--target", str(target),
                    "--draft", str(draft), "--rows", str(rows), *extra])


def test_every_system_on_every_prompt_identical_resumable_and_rendered(bp, render, checkpoints, tmp_path, capsys):
    rows_file = tmp_path / "rows.jsonl"
    assert run(bp, checkpoints, rows_file, "--repeats", "2") == 0
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["mtbench/81", "mtbench/91"]
    for r in rows:
        assert r["regime"] == "cpu" and r["prompt_set"] == "chat" and r["command"].startswith("python ")
        assert list(r["systems"]) == SYSTEMS.split(",")
        reference = r["systems"]["none"]["tokens"]
        for name, cell in r["systems"].items():
            assert cell["tokens"] == reference and 0 < len(reference) <= 6, name     # float32: exact
            assert len(cell["repeat_seconds_per_token"]) == 2
        assert r["systems"]["chain-3"]["mean_tree_size"] <= 3 and r["systems"]["dyspec-4"]["mean_tree_size"] <= 4
        assert r["systems"]["hf-assisted"]["peer_settings"]["num_assistant_tokens"] == 20
        assert r["systems"]["default"]["gb_streamed"] > 0           # --offload cpu: the layers streamed
    # Resume: nothing measured again; other settings are refused.
    assert run(bp, checkpoints, rows_file, "--repeats", "2") == 0
    assert len(rows_file.read_text().splitlines()) == 2
    with pytest.raises(SystemExit):
        run(bp, checkpoints, rows_file, "--repeats", "1")
    assert "other settings (repeats)" in capsys.readouterr().err
    # A row measured on other prompt tokens (its digest differs) is not reused: that prompt is measured again.
    lines = rows_file.read_text().splitlines()
    rows_file.write_text("\n".join([json.dumps({**json.loads(lines[0]), "prompt_digest": "other"}), *lines[1:]]) + "\n")
    assert run(bp, checkpoints, rows_file, "--repeats", "2") == 0
    assert [json.loads(line)["id"] for line in rows_file.read_text().splitlines()] == ["mtbench/81", "mtbench/91",
                                                                                      "mtbench/81"]

    section, readme = render.render([rows], ["rows.jsonl"])
    emulated = "| host RAM, chat, streamed emulation (--offload cpu) |"
    assert f"{emulated} default |" in section and "2/2 identical" in section
    assert "Default against the best fixed policy here" in section
    assert emulated in readme and "render_peers.py --rows rows.jsonl" in readme    # no CPU user's run to show


def test_offload_auto_is_the_cpu_users_run_and_the_headline(bp, render, checkpoints, tmp_path):
    """--offload auto on a CPU leaves the target resident (nothing streams); rendered beside the streamed emulation
    of the same prompts, it is the README's host-RAM line and the emulation stays on the page, labelled."""
    auto, streamed = tmp_path / "auto.jsonl", tmp_path / "streamed.jsonl"
    assert run(bp, checkpoints, auto, "--systems", "hf-assisted,none,default", "--offload", "auto") == 0
    assert run(bp, checkpoints, streamed, "--systems", "hf-assisted,none,default") == 0
    rows = [json.loads(line) for line in auto.read_text().splitlines()]
    for r in rows:
        assert r["settings"]["offload"] == "auto" and r["offload_mode"] == "none"
        assert r["systems"]["default"]["gb_streamed"] == 0
    assert all("offload" not in json.loads(line)["settings"] for line in streamed.read_text().splitlines())
    files = [rows, [json.loads(line) for line in streamed.read_text().splitlines()]]
    section, readme = render.render(files, ["auto.jsonl", "streamed.jsonl"])
    assert "| host RAM, chat | default |" in section and "--offload auto ran none" in section
    assert "| host RAM, chat, streamed emulation (--offload cpu) | default |" in section
    assert "| host RAM, chat |" in readme and "streamed emulation (--offload cpu) |" not in readme
    assert "as a CPU user runs it" in readme and "measured on" not in readme
    # Groups measured on two machines: the headline says which machine each ran on.
    other = "Other CPU (family 6 model 143; avx512f avx512_bf16 amx_bf16), 2 torch threads"
    code = [{**r, "prompt_set": "code", "stamp": {**r["stamp"], "machine": other}} for r in rows]
    _, readme = render.render([rows, code], ["auto.jsonl", "code.jsonl"])
    assert "| group | measured on | offspec s/token |" in readme
    assert f"| host RAM, code | {other} |" in readme and f"| host RAM, chat | {rows[0]['stamp']['machine']} |" in readme


def test_offload_auto_needs_the_host_ram_regime(bp, checkpoints, tmp_path):
    with pytest.raises(SystemExit):
        run(bp, checkpoints, tmp_path / "rows.jsonl", "--regime", "disk", "--offload", "auto")


def test_identity_verdicts_and_recheck(bp):
    def row(pid, tokens):
        return {"id": pid, "temperature": 0.0, "systems": {"none": {"tokens": [1, 2, 3]}, "default": {"tokens": tokens},
                                                            "chain-8": {"tokens": [1, 2, 3]}}}

    same, differs = row("a", [1, 2, 3]), row("b", [1, 9, 3])
    assert bp.verdict(same, {}, fp32_run=False) == "identical"
    assert bp.verdict(differs, {}, fp32_run=True) == "fail"
    assert bp.verdict(differs, {}, fp32_run=False) == "unchecked"
    assert bp.recheck_todo([same, differs], {}) == {"b": (2, ["default", "none"])}     # only the system that differs
    check = {"b": {"checked_tokens": 2, "systems": {"default": "identical", "none": "identical"}}}
    assert bp.verdict(differs, check, fp32_run=False) == "rounding" and bp.recheck_todo([differs], check) == {}
    other = {"b": {"checked_tokens": 2, "systems": {"chain-8": "identical", "none": "identical"}}}
    assert bp.verdict(differs, other, fp32_run=False) == "unchecked"       # a recheck of another system says nothing
    for broken in ({"default": "differs", "none": "identical"}, {"default": "identical", "none": "differs"}):
        assert bp.verdict(differs, {"b": {"checked_tokens": 2, "systems": broken}}, fp32_run=False) == "fail"


def test_a_bf16_rows_file_with_rechecks_resumes(bp, checkpoints, tmp_path):
    """bf16 rows and a stored fp32 recheck: a rerun of the same command measures nothing and is not refused."""
    rows_file = tmp_path / "rows.jsonl"
    first = run(bp, checkpoints, rows_file, "--dtype", "bfloat16", "--systems", "none,default")
    lines = rows_file.read_text().splitlines()
    timing = [json.loads(line) for line in lines if "systems" in json.loads(line) and "kind" not in json.loads(line)]
    assert len(timing) == 2
    with open(rows_file, "a") as f:
        f.write(json.dumps({"kind": bp.FP32_CHECK, "id": "elsewhere", "checked_tokens": 1, "systems": {}}) + "\n")
    assert run(bp, checkpoints, rows_file, "--dtype", "bfloat16", "--systems", "none,default") == first
    assert len(rows_file.read_text().splitlines()) == len(lines) + 1


def test_a_groups_rechecks_come_from_its_own_rows_file(render, bp):
    """Two regimes share their prompts' ids: the cold-disk group's float32 recheck of a prompt is not replaced by
    the host-RAM file's recheck of the same prompt (which covers another system)."""
    def files(regime, differs):
        tokens = {name: [1, 2, 3] for name in ("none", "default", "chain-8")}
        tokens[differs] = [1, 9, 3]
        timing = {"id": "p", "regime": regime, "prompt_set": "chat", "temperature": 0.0,
                  "settings": {"dtype": "bfloat16"}, "systems": {n: {"tokens": t} for n, t in tokens.items()}}
        check = {"kind": bp.FP32_CHECK, "id": "p", "checked_tokens": 2,
                 "systems": {differs: "identical", "none": "identical"}}
        return [timing, check]

    checks = render.group_checks([files("disk", "default"), files("cpu", "chain-8")])
    disk, cpu = (next(r for r in rows if "systems" in r and "kind" not in r)
                 for rows in (files("disk", "default"), files("cpu", "chain-8")))
    assert bp.verdict(disk, checks[("disk", "chat", "", "disk")], fp32_run=False) == "rounding"
    assert bp.verdict(cpu, checks[("cpu", "chat", "", "cpu")], fp32_run=False) == "rounding"


def test_each_sweep_file_names_the_command_that_makes_it(render):
    """The sweep table says how each of its files is made: the command its rows stored, else peer_hf.py's at the
    settings its rows record (the defaults left out)."""
    def row(pid, new_tokens, repeats, command=None):
        r = {"kind": "sweep", "id": pid, "regime": "disk", "prompt_set": "chat", "new_tokens": new_tokens,
             "settings": {"repeats": repeats}}
        return r if command is None else {**r, "command": command}

    old = [row(f"mtbench/{k}", 128, 3) for k in (85, 95)]
    assert render.sweep_command(old, "s.jsonl") == ("python scripts/peer_hf.py --regime disk --prompt-set chat "
                                                    "--prompts 2 --new-tokens 128 --repeats 3 --rows s.jsonl")
    stored = [row("mtbench/85", 64, 1, command=f"python {render.ROOT}/scripts/peer_hf.py --regime disk")]
    assert render.sweep_command(stored, "s.jsonl") == "python scripts/peer_hf.py --regime disk"


def test_default_check_names_the_best_fixed_policy(render):
    def row(pid, default, chain, dyspec):
        return {"id": pid, "systems": {"default": {"seconds_per_token": default}, "none": {"seconds_per_token": 1.0},
                                       "chain-8": {"seconds_per_token": chain},
                                       "dyspec-16": {"seconds_per_token": dyspec}}}

    rows = [row(str(k), 0.20 + k / 100, 0.30, 0.19 + k / 100) for k in range(5)]
    check = render.default_check(rows)
    assert check["best"] == "dyspec-16" and check["ok"] and check["ratio"]["ratio"] == pytest.approx(0.22 / 0.21)
    slow = [row(str(k), 0.30, 0.25, 0.40) for k in range(5)]
    assert render.default_check(slow)["best"] == "chain-8" and not render.default_check(slow)["ok"]
    # The default ran dyspec-16's rounds on every prompt (it is that policy there): 6% slower is two runs' spread.
    alike = [row(str(k), 0.212, 0.30, 0.20) for k in range(5)]
    for r in alike:
        for name in ("default", "dyspec-16"):
            r["systems"][name].update(tokens=[1, 2, 3], passes=2, mean_tree_size=15.5)
    check = render.default_check(alike)
    assert check["same"] and check["ok"] and check["ratio"]["ratio"] == pytest.approx(1.06)
    alike[2]["systems"]["default"]["passes"] = 3
    assert not render.default_check(alike)["same"] and not render.default_check(alike)["ok"]
