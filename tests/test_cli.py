"""The `offspec` command line through click's CliRunner, on tiny random checkpoints (no downloads).

What a user meets: generate (argument, file, stdin; chat template or --raw; streamed text, report, --json),
batch (txt / jsonl, bad lines, --strict, resume after an interruption or a torn line), bench, models info /
prepare, and one clean `offspec: error:` line with a non-zero exit for every bad input."""
import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import click
import pytest
import torch
from click.testing import CliRunner
from tiny import CHARS, SPECIALS, hf_config, make_model, perturbed_copy, save_checkpoint

import offspec.engine.generate
import offspec.engine.metrics
from offspec.cli.main import main
from offspec.config import OffloadConfig, RuntimeConfig, TreeConfig
from offspec.engine.generate import GenerationRequest, run
from offspec.engine.load import load_engine
from offspec.engine.prompt import encode_prompt
from offspec.plan.search import AUTO_CONCURRENCY

RUNTIME = RuntimeConfig(device=torch.device("cpu"), dtype=torch.float32)
FAST = ["--device", "cpu", "--dtype", "float32", "--offload", "none"]
PROMPT = "Write a haiku about layers."
N = 10                                   # --max-new-tokens of most runs


def printable_only(model):
    """Only character tokens can win: lm_head rows of the specials (EOS included) and the unused ids are zero,
    so the tiny models never stop early and every generated token is one visible character."""
    with torch.no_grad():
        head = model.lm_head.weight                        # (V, D)
        head[: len(SPECIALS)] = 0
        head[len(SPECIALS) + len(CHARS):] = 0
    return model


@pytest.fixture(scope="module")
def m(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    target = printable_only(make_model(hf_config("qwen2", n_layers=2), seed=7, scale=3.0))
    draft = printable_only(perturbed_copy(target, noise=0.02))
    t, d = save_checkpoint(target, root / "target"), save_checkpoint(draft, root / "draft")

    # fewer embedding rows than the tokenizer has ids (more rows would be fine: a padded vocabulary)
    other_vocab = save_checkpoint(make_model(hf_config("qwen2", n_layers=1, vocab=64), seed=3), root / "other_vocab")
    other_tok = root / "other_tok"            # same embedding rows, two tokens swapped in the tokenizer
    shutil.copytree(d, other_tok)
    tok_file = other_tok / "tokenizer.json"
    tok = json.loads(tok_file.read_text())
    vocab = tok["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    tok_file.write_text(json.dumps(tok))

    short_cfg = hf_config("qwen2", n_layers=1)
    short_cfg.max_position_embeddings = 64
    short = save_checkpoint(make_model(short_cfg, seed=5), root / "short")

    plain = load_engine(t, None, OffloadConfig(), RUNTIME, progress=False)
    return SimpleNamespace(root=root, target=t, draft=d, other_vocab=other_vocab, other_tok=other_tok, short=short,
                           plain=plain, models=["--target", str(t), "--draft", str(d)])


def cli(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input, prog_name="offspec")


def ok(result):
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def greedy(m, text, raw=False, n=N):
    """The library's plain greedy tokens: the target alone, no tree."""
    ids = encode_prompt(m.plain.tokenizer, text, raw=raw)
    report, _ = run(m.plain.engine, GenerationRequest(prompt_ids=tuple(ids), max_new_tokens=n,
                                                      tree=TreeConfig(policy="none")))
    return report


def generate_json(m, tmp_path, *args, name="r.json", input=None):
    out = tmp_path / name
    result = ok(cli("generate", *m.models, *FAST, "--max-new-tokens", N, "--json", out, *args, input=input))
    return result, json.loads(out.read_text())


def readme_report_fields() -> list[str]:
    """Every field name the report table documents (docs/options.md, linked from the README)."""
    readme = (Path(__file__).parent.parent / "docs" / "options.md").read_text()
    table = readme.split("### The report", 1)[1].split("`offspec batch` writes", 1)[0]
    return sorted({name for row in table.splitlines() if row.startswith("| `")
                   for name in re.findall(r"`([a-z_0-9]+)`", row.split("|")[1])})


# ------------------------------------------------------------------ generate
def test_generate_streams_text_report_and_json(m, tmp_path):
    result, report = generate_json(m, tmp_path, PROMPT)
    ref = greedy(m, PROMPT)
    assert report["tokens"] == ref.tokens and len(ref.tokens) == N          # speculative CLI == plain library greedy
    assert result.stdout == ref.text + "\n" and report["text"] == ref.text  # the text goes to stdout, nothing else
    assert "tokens/pass" in result.stderr and "s/token" in result.stderr    # the report goes to stderr
    fields = readme_report_fields()
    assert len(fields) > 20 and not set(fields) - set(report), set(fields) - set(report)
    assert report["new_tokens"] == N and report["finish_reason"] == "length"
    assert report["passes"] >= 1 and report["tokens_per_pass"] == pytest.approx(N / report["passes"])
    assert report["seconds_per_token"] > 0 and report["tree_policy"] == "dyspec" and report["tree_budget"] is None
    start = report["start"]                                                  # where the time before the first token went
    assert set(start) == {"open", "plan", "draft", "target", "draft_beside"} and all(v >= 0 for v in start.values())
    assert sum(start.values()) == pytest.approx(report["load_seconds"])
    first = report["load_seconds"] - start["draft_beside"] + report["prefill_seconds"]
    assert f"first token at {first:.2f} s" in result.stderr
    # the chat template was applied: more prompt tokens than the raw text, and exactly the templated ids
    raw_ids = encode_prompt(m.plain.tokenizer, PROMPT, raw=True)
    assert report["prompt_tokens"] == len(encode_prompt(m.plain.tokenizer, PROMPT)) > len(raw_ids)


def test_raw_skips_the_chat_template(m, tmp_path):
    result, report = generate_json(m, tmp_path, "--raw", "--quiet", PROMPT)
    ref = greedy(m, PROMPT, raw=True)
    assert report["prompt_tokens"] == len(encode_prompt(m.plain.tokenizer, PROMPT, raw=True))
    assert report["tokens"] == ref.tokens and result.stdout == ref.text + "\n"
    assert "tokens/pass" not in result.stderr                               # --quiet: no report


def test_prompt_from_file_and_stdin(m, tmp_path):
    expected = greedy(m, PROMPT).text + "\n"
    f = tmp_path / "prompt.md"
    f.write_text(PROMPT)
    runs = [cli("generate", *m.models, *FAST, "--max-new-tokens", N, "--prompt-file", f),
            cli("generate", *m.models, *FAST, "--max-new-tokens", N, input=PROMPT),
            cli("generate", *m.models, *FAST, "--max-new-tokens", N, "--prompt-file", "-", input=PROMPT)]
    for r in runs:
        assert ok(r).stdout == expected


def test_stop_string_cuts_the_text(m, tmp_path):
    text = greedy(m, PROMPT, n=24).text
    stop = text[10:12]
    cut = text[: text.find(stop)]
    result, report = generate_json(m, tmp_path, "--max-new-tokens", 24, "--stop", stop, "--stop", "never-seen", PROMPT)
    assert result.stdout == cut + "\n" and report["text"] == cut
    assert report["finish_reason"] == "stop"


def test_tree_none_is_plain_autoregressive(m, tmp_path):
    _, report = generate_json(m, tmp_path, "--tree", "none", PROMPT)
    assert report["tokens"] == greedy(m, PROMPT).tokens
    assert report["tree_policy"] == "none" and report["passes"] == N and report["tree_sizes"] == [0] * N


def test_fixed_budget_and_threshold(m, tmp_path):
    _, report = generate_json(m, tmp_path, "--tree", "heap", "--tree-budget", 6, "--max-depth", 4, "--branching", 3,
                              "--threshold", 0.05, PROMPT)
    assert report["tokens"] == greedy(m, PROMPT).tokens
    assert report["tree_budget"] == 6 and max(report["tree_sizes"]) <= 6


@pytest.mark.parametrize("opts", [["--draft-quant", "int8"], ["--draft-quant", "none", "--no-prune"],
                                  ["--ngram", "off", "--calibrate", "off"], ["--ngram", "on", "--calibrate", "on"]])
def test_draft_quant_pruning_and_tree_levers_keep_the_output(m, tmp_path, opts):
    _, report = generate_json(m, tmp_path, *opts, "--tree-budget", 8, PROMPT)
    assert report["tokens"] == greedy(m, PROMPT).tokens and report["tokens_per_pass"] > 1
    if "off" in opts:
        assert report["calibration"]["ngram_nodes"] == 0
        assert report["calibration"]["draft_estimate"] == report["calibration"]["draft_p"]


@pytest.mark.parametrize("dtype,expected", [("bfloat16", "int8"), ("float32", "none")])
def test_draft_quant_auto(m, monkeypatch, dtype, expected):
    """auto on a CPU: the int8 copy in bfloat16, where its kernel is the faster one for narrow calls; the dense
    draft in float32, where it is not (docs/notes/2026-11-26-draft-int8-copy.md)."""
    seen = {}

    def fake_load(models, offload, runtime, limits, progress=True, machine=None):
        seen["runtime"], seen["tree"] = runtime, None
        raise KeyboardInterrupt          # stop before loading: only the configs are checked

    monkeypatch.setattr("offspec.engine.load.Models.load", fake_load)
    cli("generate", *m.models, "--device", "cpu", "--dtype", dtype, PROMPT)
    assert seen["runtime"].draft_quant == expected


@pytest.mark.parametrize("tree", [["--tree-budget", 8], ["--tree", "none"]])
def test_sampling_options_are_seeded(m, tmp_path, tree):
    # A fixed budget: with "auto" the tree sizes follow measured timings, and with them the random draws.
    opts = [*tree, "--temperature", 0.8, "--top-p", 0.9, "--top-k", 20, PROMPT]
    _, a = generate_json(m, tmp_path, "--seed", 3, *opts, name="a.json")
    _, b = generate_json(m, tmp_path, "--seed", 3, *opts, name="b.json")
    assert a["tokens"] == b["tokens"] and len(a["tokens"]) == N


@pytest.mark.parametrize("mode", ["cpu", "disk"])
def test_offload_modes_stream_the_target(m, tmp_path, mode):
    extra = ["--store-dir", tmp_path / "store"] if mode == "disk" else []
    _, report = generate_json(m, tmp_path, "--offload", mode, *extra, PROMPT)
    assert report["tokens"] == greedy(m, PROMPT).tokens
    assert report["offload"] == mode and report["gb_streamed"] > 0 and report["weights_source"] != "resident"
    if mode == "disk":
        assert (tmp_path / "store" / "manifest.json").is_file()
        assert "reads: O_DIRECT" in report["weights_source"] or "O_DIRECT refused" in report["weights_source"]
        _, buffered = generate_json(m, tmp_path, "--offload", mode, *extra, "--disk-io", "buffered", PROMPT,
                                    name="buffered.json")
        assert buffered["tokens"] == report["tokens"] and "buffered (--disk-io buffered)" in buffered["weights_source"]


def test_offload_cpu_and_disk_tiers_in_one_run(m, tmp_path):
    """--offload cpu+disk with a host budget of one layer (of the tiny target's two): one streamed layer copied
    from host RAM, the other read from the store in the same passes; the tokens are the resident target's."""
    from offspec.formats.checkpoint import Checkpoint
    from offspec.formats.layout import BLOCK_ALIGN, N_STAGING, arena_stride, round_up
    from offspec.formats.quant import target_layout
    block = target_layout(Checkpoint(m.target, headers_only=True).config, torch.float32, "none").nbytes
    budget = arena_stride(block) + N_STAGING * round_up(block, BLOCK_ALIGN)   # one arena layer + staging
    _, report = generate_json(m, tmp_path, "--offload", "cpu+disk", "--store-dir", tmp_path / "store",
                              "--host-budget", budget, PROMPT)
    assert report["tokens"] == greedy(m, PROMPT).tokens
    assert report["offload"] == "cpu+disk" and "host arena + disk store" in report["weights_source"]
    placement = report["memory_plan"]["placement"]
    assert len(placement["host"]) == 1 and len(placement["disk"]) == 1 and report["gb_streamed"] > 0


def test_offload_auto_keeps_the_target_resident_on_cpu(m, tmp_path):
    out = tmp_path / "auto.json"
    ok(cli("generate", *m.models, "--device", "cpu", "--dtype", "float32", "--max-new-tokens", N, "--json", out, PROMPT))
    report = json.loads(out.read_text())
    assert report["offload"] == "none" and report["weights_source"] == "resident"


def test_engine_is_closed_and_ctrl_c_exits_130(m, monkeypatch):
    closed = []
    real_close = offspec.engine.generate.Engine.close
    monkeypatch.setattr(offspec.engine.generate.Engine, "close", lambda self: (closed.append(1), real_close(self)))
    ok(cli("generate", *m.models, *FAST, "--max-new-tokens", 2, PROMPT))
    assert closed == [1]

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(offspec.engine.generate, "run", interrupted)
    result = cli("generate", *m.models, *FAST, "--offload", "cpu", PROMPT)
    assert result.exit_code == 130 and "Traceback" not in result.output
    assert result.stderr.strip().splitlines()[-1] == "offspec: interrupted"
    assert closed == [1, 1]


# ------------------------------------------------------------------ batch
def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read_results(path):
    text = path.read_text()
    assert text == "" or text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


BATCH_FIELDS = {"id", "text", "tokens", "seconds_per_token", "tokens_per_pass", "passes", "prompt_tokens",
                "finish_reason"}


def test_batch_txt(m, tmp_path):
    prompts = write_jsonl(tmp_path / "p.txt", ["first prompt", "", "second prompt"])
    out = tmp_path / "out.jsonl"
    result = ok(cli("batch", prompts, "-o", out, *m.models, *FAST, "--max-new-tokens", 4))
    rows = sorted(read_results(out), key=lambda r: r["id"])     # written as they finish: either may come first
    assert [r["id"] for r in rows] == ["line-1", "line-3"]
    assert all(set(r) == BATCH_FIELDS and len(r["tokens"]) == 4 for r in rows)
    assert rows[0]["tokens"] == greedy(m, "first prompt", n=4).tokens
    assert "done: 2 prompts" in result.stderr


def test_batch_jsonl_bad_lines_and_strict(m, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [
        {"id": "a", "prompt": "hello", "max_new_tokens": 3},
        {"id": "b", "messages": [{"role": "user", "content": "hi there"}]},
        "{not json",
        {"id": "c", "prompt": "x" * 600},              # longer than the tiny model's 512-token context
        {"id": 7, "prompt": "the last one"},
    ])
    out = tmp_path / "out.jsonl"
    result = ok(cli("batch", prompts, "-o", out, *m.models, *FAST, "--max-new-tokens", 5))
    rows = {r["id"]: r for r in read_results(out)}
    assert sorted(rows) == ["7", "a", "b"]
    assert len(rows["a"]["tokens"]) == 3 and len(rows["b"]["tokens"]) == 5 and len(rows["7"]["tokens"]) == 5
    assert rows["b"]["tokens"] == greedy(m, [{"role": "user", "content": "hi there"}], n=5).tokens
    assert "line 3: not valid JSON" in result.stderr
    assert "line 4 (id c)" in result.stderr and "context" in result.stderr
    assert "skipped 2 bad" in result.stderr

    strict = cli("batch", prompts, "-o", tmp_path / "strict.jsonl", *m.models, *FAST, "--strict")
    assert_clean_error(strict, "line 3", "not valid JSON")
    assert not (tmp_path / "strict.jsonl").exists()                # stopped before any work


@pytest.mark.parametrize("concurrency", [1, 3])
def test_batch_interrupted_then_resumed_loses_and_duplicates_nothing(m, tmp_path, monkeypatch, concurrency):
    ids = [f"p{i}" for i in range(6)]
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": i, "prompt": f"prompt number {i}"} for i in ids])
    out = tmp_path / "out.jsonl"
    args = ["batch", prompts, "-o", out, *m.models, *FAST, "--max-new-tokens", 3, "--concurrency", concurrency]

    calls, real_run = [], offspec.engine.metrics.report_of

    def run_then_ctrl_c(*a, **kw):          # Ctrl-C as the third prompt finishes
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_run(*a, **kw)
    monkeypatch.setattr(offspec.engine.metrics, "report_of", run_then_ctrl_c)
    result = cli(*args)
    assert result.exit_code == 130 and "Traceback" not in result.output
    assert "rerun to resume" in result.stderr
    kept = [r["id"] for r in read_results(out)]                   # finished lines kept, each complete (in the
    assert len(kept) == len(set(kept)) == 2 and set(kept) <= set(ids)   # order rows finish: any, with 3 rows)

    monkeypatch.setattr(offspec.engine.metrics, "report_of", real_run)
    result = ok(cli(*args))
    assert "resuming: 2 of 6" in result.stderr
    rows = read_results(out)
    assert sorted(r["id"] for r in rows) == ids and len(rows) == len(ids)
    assert all(set(r) == BATCH_FIELDS and len(r["tokens"]) == 3 for r in rows)

    assert "nothing to do" in ok(cli(*args)).stderr                 # a third run changes nothing
    assert len(read_results(out)) == len(ids)


def test_batch_repairs_a_torn_last_line(m, tmp_path):
    prompts = write_jsonl(tmp_path / "p.txt", ["one", "two", "three"])
    out = tmp_path / "out.jsonl"
    args = ["batch", prompts, "-o", out, *m.models, *FAST, "--max-new-tokens", 2]
    ok(cli(*args))
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:2]) + lines[2][:15])             # killed in the middle of the last write
    ok(cli(*args))
    rows = read_results(out)
    assert [r["id"] for r in rows] == ["line-1", "line-2", "line-3"]


def test_batch_openai_lines_honour_their_body_and_answer_in_openai_shape(m, tmp_path):
    """A line's temperature, seed and stop do what the same options do for a plain line; results are OpenAI
    batch output lines, and a rerun resumes by custom_id."""
    messages = [{"role": "user", "content": "tell me"}]
    stop = greedy(m, messages, n=8).text[3:5]
    openai = write_jsonl(tmp_path / "openai.jsonl", [
        {"custom_id": "hot", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": messages, "max_tokens": 6, "temperature": 0.8, "seed": 3}},
        {"custom_id": "cut", "body": {"messages": messages, "max_tokens": 8, "stop": stop}},
        {"custom_id": "many", "body": {"messages": messages, "n": 2}},
    ])
    out = tmp_path / "out.jsonl"
    alone = ["--tree", "none", "--concurrency", 1]     # a sample's tokens then depend on the seed alone
    result = ok(cli("batch", openai, "-o", out, *m.models, *FAST, *alone))
    assert "body.n = 2 is not supported" in result.stderr
    rows = {r["custom_id"]: r for r in read_results(out)}
    assert sorted(rows) == ["cut", "hot"]
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in rows.values())
    hot, cut = (rows[k]["response"]["body"] for k in ("hot", "cut"))
    assert hot["model"] == "m" and hot["usage"]["completion_tokens"] == 6

    def plain(name, *args):
        prompts = write_jsonl(tmp_path / f"{name}.jsonl", [{"id": name, "messages": messages}])
        ok(cli("batch", prompts, "-o", tmp_path / f"{name}.out", *m.models, *FAST, *alone, *args))
        return read_results(tmp_path / f"{name}.out")[0]
    assert hot["choices"][0]["message"]["content"] == plain("hot", "--max-new-tokens", 6, "--temperature", 0.8,
                                                            "--seed", 3)["text"]
    cut_plain = plain("cut", "--max-new-tokens", 8, "--stop", stop)
    assert cut["choices"][0]["message"]["content"] == cut_plain["text"] and stop not in cut_plain["text"]
    assert cut_plain["finish_reason"] == "stop" and cut["choices"][0]["finish_reason"] == "stop"

    result = cli("batch", openai, "-o", out, *m.models, *FAST)              # resumed: only the refused line is left
    assert "resuming: 2 of 2" in result.stderr and "nothing to do" in result.stderr


def test_every_json_report_says_which_offspec_models_settings_and_tokens_per_second(m, tmp_path):
    from offspec.engine.metrics import offspec_version
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "x", "prompt": "a prompt that is long enough"}])
    runs = {"generate": (["generate", *m.models, *FAST, "--max-new-tokens", 4, PROMPT], "tokens_per_second"),
            "batch": (["batch", prompts, "-o", tmp_path / "out.jsonl", *m.models, *FAST, "--max-new-tokens", 4],
                      "tokens_per_second"),
            "bench": (["bench", prompts, *m.models, *FAST, "--prompt-tokens", 8, "--new-tokens", 4, "--temperatures",
                       "0"], "seconds_per_token")}
    for command, (args, speed) in runs.items():
        out = tmp_path / f"{command}.json"
        ok(cli(*args, "--json", out))
        report = json.loads(out.read_text())
        assert report["offspec"] == {"version": offspec_version(), "command": f"offspec {command}"}
        assert report["models"] == {"target": str(m.target), "draft": str(m.draft)}
        options = report["options"]
        assert (options["target"], options["device"], options["dtype"], options["json_path"]) == (
            str(m.target), "cpu", "float32", str(out))
        assert options["policy"] == "auto" and options["tree_budget"] == "auto"        # defaults filled in
        speed_of = report["summary"][0][speed]["median"] if command == "bench" else report[speed]
        assert speed_of > 0


def test_batch_with_no_valid_line_fails_and_a_finished_one_has_nothing_to_do(m, tmp_path):
    """Every line bad: the job had nothing valid to run, exit 2 with one line saying so (no result file made);
    every id already in OUT: nothing to do, exit 0."""
    prompts = write_jsonl(tmp_path / "p.jsonl", ["{not json", "[1, 2]", {"id": "x"}])
    out = tmp_path / "out.jsonl"
    result = cli("batch", prompts, "-o", out, *m.models, *FAST)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "no valid prompt found" in result.stderr and "nothing to do" not in result.stderr
    assert not out.exists()
    # Lines that parse, none of which can be encoded (chat messages with --raw): the same failure.
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"id": "c", "messages": [{"role": "user", "content": "hi"}]}])
    result = cli("batch", chat, "-o", out, "--raw", *m.models, *FAST)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "no prompt could be encoded (1 skipped)" in result.stderr

    prompts = write_jsonl(tmp_path / "p.txt", ["one"])
    ok(cli("batch", prompts, "-o", out, *m.models, *FAST, "--max-new-tokens", 2))
    assert "nothing to do" in ok(cli("batch", prompts, "-o", out, *m.models, *FAST)).stderr


# ------------------------------------------------------------------ bench
def test_bench_table_rows_resume_and_json(m, tmp_path):
    """Every system on every prompt and temperature, one row each; at T=0 every system writes plain greedy's
    tokens; a rerun with the same --rows measures nothing and reports the same rows."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "x", "prompt": "a prompt that is long enough"},
                                                 {"id": "y", "messages": [{"role": "user", "content": "hello"}]}])
    out, rows = tmp_path / "bench.json", tmp_path / "rows.jsonl"
    args = ("bench", prompts, *m.models, *FAST, "--prompt-tokens", 8, "--new-tokens", 6, "--temperatures", "0,0.6",
            "--tree-budget", 4, "--systems", "default,none,chain-3", "--repeats", 2, "--rows", rows)
    result = ok(cli(*args, "--json", out))
    assert "vs none" in result.stdout and "chain-3" in result.stdout and result.stdout.count("temperature") == 2
    data = json.loads(out.read_text())
    assert {(r["temperature"], r["system"]) for r in data["summary"]} == {
        (t, s) for t in (0.0, 0.6) for s in ("default", "none", "chain-3")}
    assert len(data["rows"]) == 2 * 2 and len(rows.read_text().splitlines()) == 4
    for row in data["rows"]:
        assert row["new_tokens"] == 6 and set(row["stamp"]) == {"commit", "time", "load_average", "machine"}
        for cell in row["systems"].values():
            assert len(cell["tokens"]) == 6 and len(cell["repeat_seconds_per_token"]) == 2
        assert row["systems"]["chain-3"]["mean_tree_size"] <= 3
        if row["temperature"] == 0.0:
            assert row["systems"]["default"]["tokens"] == row["systems"]["none"]["tokens"] == \
                row["systems"]["chain-3"]["tokens"]
    greedy = [s for s in data["summary"] if s["temperature"] == 0.0]
    assert all(s["identical"] == 2 for s in greedy)
    again = ok(cli(*args))
    assert "T=0" not in again.stderr and len(rows.read_text().splitlines()) == 4    # nothing measured again
    assert "chain-3" in again.stdout
    assert data["rows"][0]["settings"]["new_tokens"] == 6 and data["rows"][0]["plan"]["offload"]
    changed = list(args)
    changed[changed.index("--new-tokens") + 1] = 5
    assert_clean_error(cli(*changed), "other settings (new_tokens)")


# ------------------------------------------------------------------ models
def test_models_info(m):
    out = ok(cli("models", "info", m.target, "--dtype", "float32", "--offload", "cpu", "--link-gbps", 10)).stdout
    for needle in ("architecture:    qwen2 (Qwen2ForCausalLM)", "parameters:", "layers:          2",
                   "bytes per layer:", "PREDICTED pass:", "at 10 GB/s"):
        assert needle in out


@pytest.mark.parametrize("draft,needle", [
    ("draft", None),
    ("other_tok", "WARNING:         draft and target tokenizers differ"),
    ("other_vocab", "WARNING:         draft other_vocab: 64 embedding rows, but its tokenizer has 101 token ids"),
])
def test_models_info_warns_of_a_draft_that_cannot_speculate(m, tmp_path, draft, needle):
    out = ok(cli("models", "info", m.target, "--draft", getattr(m, draft))).stdout
    assert needle in out if needle else "WARNING" not in out


def test_models_info_without_tokenizer_files_compares_the_row_counts(tmp_path):
    """Headers only: a vocabulary padded to another round number is no mismatch; another tokenizer is."""
    from shapes import headers_only_checkpoint

    llama3, llama2, qwen, qwen_draft = (headers_only_checkpoint(tmp_path, name) for name in (
        "Llama-3.1-70B-Instruct", "TinyLlama-1.1B-Chat-v1.0", "Qwen2.5-72B-Instruct", "Qwen2.5-0.5B-Instruct"))
    machine = ["--device-memory", "24GB", "--host-memory", "64GB"]
    out = ok(cli("models", "info", llama3, "--draft", llama2, *machine)).stdout
    assert "WARNING:         the draft has 32000 embedding rows and the target 128256" in out
    assert "WARNING" not in ok(cli("models", "info", qwen, "--draft", qwen_draft, *machine)).stdout


def test_float16_on_a_cpu_warns_and_runs(m):
    result = ok(cli("generate", *m.models, *FAST, "--dtype", "float16", "--max-new-tokens", "4", PROMPT))
    assert "offspec: warning: --dtype float16 on a CPU" in result.stderr and "use bfloat16" in result.stderr
    assert "warning" not in ok(cli("generate", *m.models, *FAST, "--max-new-tokens", "4", PROMPT)).stderr


def test_models_prepare_then_disk_generate_and_corrupt_stores(m, tmp_path):
    store = tmp_path / "store"
    result = ok(cli("models", "prepare", m.target, "--dtype", "float32", "--store-dir", store))
    assert result.stdout.strip() == str(store) and (store / "layers.bin").is_file()
    mtime = (store / "layers.bin").stat().st_mtime_ns
    disk = [*m.models, "--device", "cpu", "--dtype", "float32", "--offload", "disk", "--max-new-tokens", 4]
    _, report = generate_json(m, tmp_path, *disk[4:], "--store-dir", store, PROMPT)
    assert report["tokens"] == greedy(m, PROMPT, n=4).tokens and "disk" in report["weights_source"]
    assert (store / "layers.bin").stat().st_mtime_ns == mtime          # the prepared store was used, not rebuilt

    flipped, truncated = tmp_path / "flipped", tmp_path / "truncated"
    shutil.copytree(store, flipped)
    shutil.copytree(store, truncated)
    with open(flipped / "layers.bin", "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with open(truncated / "layers.bin", "r+b") as f:
        f.truncate((truncated / "layers.bin").stat().st_size - 4096)
    assert_clean_error(cli("generate", *disk, "--store-dir", flipped, PROMPT), "checksum")
    assert_clean_error(cli("generate", *disk, "--store-dir", truncated, PROMPT), "truncated")


def test_os_error_on_the_loader_thread_is_one_line(m, tmp_path, monkeypatch):
    """An I/O error while streaming arrives wrapped from the loader thread; the CLI still prints one line."""
    import errno

    import offspec.stream.disk

    def failing_read(self, layer, out, offset, gate):   # a DiskStore reader thread's read of one piece
        raise OSError(errno.EIO, "Input/output error", "layers.bin")
    disk = ["--device", "cpu", "--dtype", "float32", "--offload", "disk", "--store-dir", tmp_path / "store"]
    ok(cli("models", "prepare", m.target, "--dtype", "float32", "--store-dir", tmp_path / "store"))
    monkeypatch.setattr(offspec.stream.disk.DiskStore, "_read_piece", failing_read)
    assert_clean_error(cli("generate", *m.models, *disk, PROMPT), "Input/output error: layers.bin")


# ------------------------------------------------------------------ bad input
def assert_clean_error(result, *needles, usage=False):
    """A non-zero exit, no traceback, and the last stderr line is the one error line."""
    assert result.exit_code != 0, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("Error:" if usage else "offspec: error:"), result.stderr
    for needle in needles:
        assert needle in last, last


def bad_folder(m, name, edit):
    folder = m.root / name
    if not folder.exists():
        shutil.copytree(m.target, folder)
        edit(folder)
    return folder


def _unsupported(folder):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (folder / "config.json").write_text(json.dumps(cfg))


def _truncate_weights(folder):
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _garble_header(folder):
    f = folder / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:40] = b"\xff" * 32
    f.write_bytes(bytes(data))


def _drop_tokenizer(folder):
    for file in folder.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            file.unlink()


@pytest.mark.parametrize("case", ["missing", "no_config", "unsupported", "truncated", "garbled", "no_tokenizer"])
def test_bad_target_folders(m, tmp_path, case):
    folder = {
        "missing": lambda: tmp_path / "nope",
        "no_config": lambda: tmp_path,
        "unsupported": lambda: bad_folder(m, "unsupported", _unsupported),
        "truncated": lambda: bad_folder(m, "truncated", _truncate_weights),
        "garbled": lambda: bad_folder(m, "garbled", _garble_header),
        "no_tokenizer": lambda: bad_folder(m, "no_tokenizer", _drop_tokenizer),
    }[case]()
    needle = {"missing": "no such model folder", "no_config": "no config.json",
              "unsupported": "unsupported architecture GPT2LMHeadModel", "truncated": "model.safetensors",
              "garbled": "model.safetensors", "no_tokenizer": "no tokenizer files"}[case]
    assert_clean_error(cli("generate", "--target", folder, "--draft", m.draft, *FAST, PROMPT), needle)
    if case == "truncated":     # the headers are whole: enough to plan, and info says the data is not
        assert "weights incomplete (enough to plan, not to run)" in ok(cli("models", "info", folder)).stdout
    elif case == "no_tokenizer":    # planning reads no tokenizer
        ok(cli("models", "info", folder))
    else:
        assert_clean_error(cli("models", "info", folder), needle)


@pytest.mark.parametrize("draft,needles", [
    ("other_vocab", ("draft ", "other_vocab: 64 embedding rows, but its tokenizer has 101 token ids")),
    ("other_tok", ("tokenizers differ", "2 with different ids", "'a' is 4 in the target, 5 in the draft")),
])
def test_draft_with_another_tokenizer(m, draft, needles):
    result = cli("generate", "--target", m.target, "--draft", getattr(m, draft), *FAST, PROMPT)
    assert_clean_error(result, *needles)


def test_prompt_longer_than_the_context(m):
    result = cli("generate", "--target", m.short, "--tree", "none", *FAST, "--raw", "y" * 100)
    assert_clean_error(result, "100 tokens", "context holds only 64")


def test_bad_prompts_and_prompt_files(m, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    csv = tmp_path / "p.csv"
    csv.write_text("a,b\n")
    gen = ["generate", *m.models, *FAST]
    assert_clean_error(cli(*gen, "   "), "the prompt is empty")
    assert_clean_error(cli(*gen, input=""), "the prompt is empty")
    assert_clean_error(cli(*gen, "--prompt-file", empty), "the prompt is empty")
    assert_clean_error(cli(*gen, "--prompt-file", tmp_path / "missing.txt"), "cannot read prompt file")
    assert_clean_error(cli(*gen, "--prompt-file", binary), "cannot read prompt file")
    assert_clean_error(cli(*gen, "--prompt-file", empty, PROMPT), "not both")
    assert_clean_error(cli(*gen, "--prompt-file", tmp_path), "is a directory", usage=True)
    out = ["-o", tmp_path / "o.jsonl"]
    assert_clean_error(cli("batch", csv, *out, *m.models, *FAST), "unknown prompt file type '.csv'")
    assert_clean_error(cli("batch", empty, *out, *m.models, *FAST), "no prompts")
    assert_clean_error(cli("batch", tmp_path / "missing.jsonl", *out, *m.models, *FAST), "cannot read prompt file")
    assert_clean_error(cli("bench", csv, *m.models, *FAST), "unknown prompt file type")


def test_unwritable_outputs(m, tmp_path):
    prompts = write_jsonl(tmp_path / "p.txt", ["hi"])
    missing = tmp_path / "no" / "such" / "folder"
    gen = ["generate", *m.models, *FAST, PROMPT]
    assert_clean_error(cli(*gen, "--json", missing / "r.json"), "does not exist")
    assert_clean_error(cli(*gen, "--json", tmp_path), "is a directory", usage=True)
    assert_clean_error(cli("batch", prompts, "-o", missing / "o.jsonl", *m.models, *FAST), "does not exist")
    assert_clean_error(cli("batch", prompts, "-o", tmp_path, *m.models, *FAST), "is a directory", usage=True)
    assert_clean_error(cli("bench", prompts, *m.models, *FAST, "--json", missing / "b.json"), "does not exist")


@pytest.mark.parametrize("args,needle", [
    (["--dtype", "float64"], "unknown dtype 'float64'"),
    (["--device", "cuda"], "CUDA is not available"),
    (["--device", "tpu"], "unknown device 'tpu'"),
    (["--offload", "cpu", "--gpu-budget", "100KB"], "too small to stream"),
    (["--gpu-budget", "lots"], "cannot read 'lots' as a size"),
    (["--tree-budget", "abc"], "--tree-budget must be 'auto' or a whole number"),
    (["--max-depth", "deep"], "--max-depth must be 'auto' or a whole number"),
    (["--max-depth", "0"], "--max-depth must be at least 1"),
    (["--branching", "0"], "--branching must be at least 1"),
    (["--slots", "1"], "--slots must be at least 2"),
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--top-k", "-3"], "--top-k"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--threshold", "2"], "--threshold"),
])
def test_bad_options(m, args, needle):
    assert_clean_error(cli("generate", *m.models, *FAST, *args, PROMPT), needle)


def test_malformed_options_are_usage_errors(m):
    assert_clean_error(cli("generate", *m.models, *FAST, "--offload", "gpu", PROMPT), "--offload", usage=True)
    assert_clean_error(cli("generate", *m.models, *FAST, "--slots", "two", PROMPT), "--slots", usage=True)
    assert_clean_error(cli("generate", *m.models, *FAST, "--tree", "forest", PROMPT), "--tree", usage=True)


def test_bad_bench_and_models_options(m, tmp_path):
    prompts = write_jsonl(tmp_path / "p.txt", ["hi"])
    assert_clean_error(cli("bench", prompts, *m.models, *FAST, "--temperatures", "0,hot"), "--temperatures")
    assert_clean_error(cli("bench", prompts, *m.models, *FAST, "--new-tokens", 0), "--new-tokens")
    assert_clean_error(cli("bench", prompts, *m.models, *FAST, "--systems", "none,forest-3"), "unknown system")
    assert_clean_error(cli("bench", prompts, *m.models, *FAST, "--systems", "default,chain-8"), "--systems must name")
    assert_clean_error(cli("models", "info", m.target, "--dtype", "int8"), "unknown dtype")
    assert_clean_error(cli("models", "prepare", tmp_path / "nope", "--store-dir", tmp_path / "s"),
                       "no such model folder")


# ------------------------------------------------------------------ help
def all_commands(group=main, path=()):
    yield path, group
    for name, command in getattr(group, "commands", {}).items():
        yield from all_commands(command, (*path, name))


@pytest.mark.parametrize("path,command", list(all_commands()),
                         ids=[" ".join(("offspec", *p)) for p, _ in all_commands()])
def test_help_explains_every_option_with_its_default(path, command):
    if not path:
        assert re.fullmatch(r"offspec, version \S+\n", ok(cli("--version")).stdout)
    result = ok(cli(*path, "--help"))
    assert command.get_short_help_str() and f"Usage: {' '.join(('offspec', *path))}" in result.output
    for param in command.params:
        if not isinstance(param, click.Option) or param.is_flag or param.required or param.name == "help":
            continue
        assert param.help, f"{' '.join(path)} {param.opts[0]} has no help"
        assert param.show_default or "default" in param.help.lower(), f"{' '.join(path)} {param.opts[0]}: no default"
        assert param.opts[0] in result.output


@pytest.mark.parametrize("name", ["generate", "batch", "bench"])
def test_help_puts_the_common_options_first_and_lists_each_once(name):
    """Two sections: the options most runs set, then "Advanced options"; every option (and its help) once."""
    from offspec.cli.options import ESSENTIAL_OPTIONS

    command = main.commands[name]
    result = CliRunner().invoke(main, [name, "--help"], prog_name="offspec", terminal_width=120)
    common, advanced = ok(result).output.split("\nOptions:\n")[1].split("\nAdvanced options:\n")
    starts = [line.split()[0].rstrip(",") for line in (common + advanced).splitlines() if line.startswith("  -")]
    options = [p for p in command.params if isinstance(p, click.Option)] + [command.get_help_option(click.Context(command))]
    assert sorted(starts) == sorted(p.opts[0] for p in options)             # each option once, no other
    for p in options:
        essential = p.name in ESSENTIAL_OPTIONS or p.opts[0] == "--help"
        section = common if essential else advanced
        assert re.search(rf"^  {re.escape(p.opts[0])}\b", section, re.MULTILINE), (p.opts[0], essential)
    assert 10 <= sum(p.name in ESSENTIAL_OPTIONS for p in options) <= 14 < len(options) - 14
    for p in options[:-1]:
        assert " ".join(p.help.split())[:40] in " ".join(result.output.split())


def test_batch_concurrency_gives_the_same_lines_and_a_job_report(m, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"q{i}", "prompt": f"question {i}: " + "why? " * i,
                                                   "max_new_tokens": 3 + i} for i in range(5)])
    lines = {}
    for concurrency in (1, 3):
        out, job = tmp_path / f"out{concurrency}.jsonl", tmp_path / f"job{concurrency}.json"
        result = ok(cli("batch", prompts, "-o", out, *m.models, *FAST, "--tree-budget", 8,
                        "--concurrency", concurrency, "--json", job))
        lines[concurrency] = {r["id"]: r["tokens"] for r in read_results(out)}
        report = json.loads(job.read_text())
        assert report["prompts"] == 5 and report["concurrency"] == concurrency
        assert report["generated_tokens"] == sum(3 + i for i in range(5)) and report["tokens_per_second"] > 0
        assert report["rows_per_pass"] > (1.5 if concurrency == 3 else 0.99)
        assert report["target_seconds_per_pass"] > 0 and report["draft_seconds_per_pass"] > 0
        assert report["stream_gb_per_second"] is None and report["wait_seconds_per_pass"] == 0   # nothing streamed
        assert "tokens/s" in result.stderr and "prompts and" in result.stderr
        assert "a pass: draft " in result.stderr and "waiting for weights" not in result.stderr
    assert lines[1] == lines[3]
    # auto: the memory plan's most rows, no more than the job's 5 prompts (the costs may keep fewer in flight).
    out, job = tmp_path / "auto.jsonl", tmp_path / "auto.json"
    ok(cli("batch", prompts, "-o", out, *m.models, *FAST, "--tree-budget", 8, "--concurrency", "auto", "--json", job))
    assert {r["id"]: r["tokens"] for r in read_results(out)} == lines[1]
    assert json.loads(job.read_text())["concurrency"] == min(AUTO_CONCURRENCY, 5)
    assert f"up to {AUTO_CONCURRENCY}, that the memory plan fits" in " ".join(ok(cli("batch", "--help")).output.split())
    # Streamed: the report says where a pass went, the stream's rate included.
    out, job = tmp_path / "streamed.jsonl", tmp_path / "streamed.json"
    result = ok(cli("batch", prompts, "-o", out, *m.models, *FAST[:-1], "cpu", "--tree-budget", 8,
                    "--concurrency", 3, "--json", job))
    assert {r["id"]: r["tokens"] for r in read_results(out)} == lines[1]
    report = json.loads(job.read_text())
    assert report["stream_gb_per_second"] > 0 and 0 <= report["wait_seconds_per_pass"] <= report["target_seconds_per_pass"]
    assert report["gb_streamed_per_token"] > 0 and report["peak_device_gb"] is None          # a CPU run
    assert "s of it waiting for weights streamed at" in result.stderr
    # Prompts joining in chunks of 2 tokens a pass beside decoding ones: the same lines again.
    out = tmp_path / "chunked.jsonl"
    ok(cli("batch", prompts, "-o", out, *m.models, *FAST, "--tree-budget", 8, "--concurrency", 3,
           "--prefill-per-pass", 2))
    assert {r["id"]: r["tokens"] for r in read_results(out)} == lines[1]
    bad = cli("batch", prompts, "-o", tmp_path / "bad.jsonl", *m.models, *FAST, "--prefill-per-pass", "0")
    assert bad.exit_code != 0 and "--prefill-per-pass must be at least 1" in bad.stderr
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
