"""Every benchmark script runs: each in a process of its own with its tiny CPU configuration, exits 0 and prints its
table, so a changed signature in the package breaks CI instead of the next GPU run. The shell scripts parse, and
gpu_suite.sh's dry run names only scripts that exist; two_gpu_moe_parallel.sh's dry run (2 gloo CPU ranks) passes.

CUDA is hidden from the runs: these are the CPU smoke configurations whatever the machine. The scripts' processes are
forked by tests/script_server.py, which has made their common imports (torch, transformers, this package) once: a
fresh interpreter would spend most of a tiny run on them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"

# (script, the arguments of its tiny CPU configuration, texts its output holds: its tables, or its line that the part
# needs CUDA)
RUNS = [
    ("bench_attention_step.py", ["--tiny"], ["torch path, us", "1x4x64 |", "skipped (needs CUDA)"]),
    ("bench_conversion.py", ["--tiny"], ["fast_llm -> hf", "hf -> fast_llm", "HF output: 1 safetensors file"]),
    ("bench_conversion.py", ["--planning"], ["build_fast_llm_rows:", "whole model on meta"]),
    ("bench_decode_gemv.py", ["--tiny", "--batches", "1"],
     ["the Triton GEMV: skipped", "gdn in_proj, gathered", "mlp gate+up, with SwiGLU"]),
    ("bench_delta_rule.py", ["--tiny"], ["theirs/ours", "GDN Hk=4 Hv=8 d=64", "KDA H=8 d=64"]),
    ("bench_flagships.py", ["--tiny", "--repeats", "1"],
     ["=== qwen3-next-fp8", "qwen3-next-fp8 beside vLLM", "qwen3-next-bf16: decoding tok/s",
      "kimi-linear: time to first token", "warm ratio transformers / ours", "same weights: max |logits"]),
    ("bench_fp8_linear.py", ["--tiny", "--rows", "1", "16"],
     ["the Triton kernels: skipped", "gdn in_proj_qkvz", "expert gate+up", "scaled_mm: not timed"]),
    ("bench_generation.py", ["--device", "cpu", "--tiny", "--repeats", "1", "--batches", "1"],
     ["GDN vs Qwen3-Next", "KDA vs Kimi-Linear", "prefill, batch 1"]),
    ("bench_kimi_linear.py", ["--size", "tiny", "--decode", "1", "--repeats", "1", "--threads", "1"],
     ["same weights:", "ratio ours / transformers", "ours' static cache (batch 1"]),
    ("bench_loading.py", ["--tiny"], ["qwen3-next-fp8, tiny:", "streamed / mapped: seconds", "True | True"]),
    ("bench_long_context.py", ["--tiny"], ["gdn vs Qwen3-Next: batch 1", "kda vs Kimi-Linear: batch 1", "prefill ratio",
                                           "YaRN factor 4"]),
    # a subprocess per row: the linear layers' rows, and the one that patches the model (transformers' 4-D mask)
    ("bench_memory.py", ["--lengths", "64", "--rows", "sliding_attention (4-D mask)", "gated_deltanet",
                         "kimi_delta_attention", "full_attention, left-padded (4-D mask)"],
     ["| sliding_attention (4-D mask) |", "| gated_deltanet |", "| kimi_delta_attention |",
      "| full_attention, left-padded (4-D mask) |"]),
    ("bench_mla_cache.py", [], ["| Kimi-Linear 48B-A3B |"]),
    ("bench_mla_static_prefill.py", ["--prompt", "16", "--slots", "16", "64", "--repeats", "1"],
     ["max_cache_len     64"]),
    ("bench_mtp_acceptance.py", ["--tiny"],
     ["held out: loss", "| plain | 1 | - |", "| plain, static cache | 2 | - |", "| MTP | 1 | 1 |", "| MTP | 1 | 4 |",
      "| copy: prompt lookup | 1 | 4 |", "| copy: prompt lookup | 2 | 4 |", "acceptance length",
      "copy task: plain greedy reproduces", "of its new 4-grams are in the chunk",
      "of their new 4-grams occurred earlier"]),
    # Fast-LLM's parallel heads, one per draft
    ("bench_mtp_acceptance.py", ["--tiny", "--mtp-type", "fast_llm", "--mtp-k", "1", "3"],
     ["the mean of its depths'", "| MTP | 1 | 3 |", "| MTP | 2 | 3 |"]),
    ("bench_moe.py", ["--size", "tiny", "--repeats", "1", "--decode", "1", "--prompt", "16", "--new-tokens", "4",
                      "--threads", "1"],
     ["routing (router", "Whole model, fwd+bwd", "ours/eager"]),
    # the batched way alone (a fresh process per pair, side and way: 4 with one way): its batches of 2 and of 1 (the
    # last of 3 requests) run the single way's batch-1 generate too
    ("bench_trace.py", ["--tiny", "--cache", "static", "--ways", "batched", "--requests", "3", "--batch", "2",
                        "--threads", "1"],
     ["gdn: tokens/s", "kda: tokens/s", "batched  ratio"]),
    # one slice of the trace (requests 1 and 2 of 3), one side and way
    ("bench_trace.py", ["--tiny", "--models", "gdn", "--sides", "ours", "--ways", "single", "--requests", "3",
                        "--slice", "1:3", "--threads", "1"], ["slice: requests 1..2 of the trace", "gdn: tokens/s"]),
    ("bench_training.py", ["--tiny"],
     ["GDN vs Qwen3-Next: ours/transformers tokens/s", "KDA vs Kimi-Linear: ours/transformers tokens/s"]),
    ("bench_verify_step.py", ["--tiny"], ["one-token decoding step (eager)", "| 4 | skipped (needs CUDA) | - |",
                                          "verify(4) / step =", "| plain, static cache |", "| use_mtp=4 |"]),
    ("count_decode_ops.py", [], ["kernels in the captured decoding step", "around the replay"]),
    ("count_decode_ops.py", ["--model", "kimi", "--eager"], ["kernels per eager decoding step"]),
    ("count_decode_ops.py", ["--model", "qwen3-next-fp8", "--by-site"],
     ["qwen3-next-fp8: ", "fp8.routed_linear", "moe.route_top_k", "moe.add_gated"]),
    ("count_decode_ops.py", ["--verify", "4"], ["kernels in a verify round of 4 tokens", "in the captured decoding"]),
    ("diagnose_first_calls.py", ["--tiny"], ["pkg capture s", "forward      40 |"]),
    ("diagnose_first_calls.py", ["--tiny", "--model", "qwen3-next-fp8", "--caches", "static"],
     ["model qwen3-next-fp8", "  static      33 |"]),
    ("decode_host_overhead.py", ["--tokens", "4", "--models", "gdn"], ["of host time per token around the replay"]),
    ("profile_decode_step.py", ["--tiny", "--steps", "2", "--top", "5"],
     ["gdn (tiny, CPU):", "kda (tiny, CPU):", "ms/step  share n/step  op", "aten::mm"]),
    ("profile_gpu.py", ["--tiny"], ["ours training step", "transformers eager decoding step",
                                    "graph decoding: skipped, a CUDA-graph replay needs a CUDA device"]),
]
# model_configs.py, flagship_models.py and timing.py are the others' modules, not scripts; make_finetune_example.py
# writes the data of two_gpu_finetune.sh (a 109 MB model), not a benchmark
NOT_RUN = {"model_configs.py", "make_finetune_example.py", "flagship_models.py", "timing.py"}


def environment(**env: str) -> dict[str, str]:
    """This process's environment with CUDA hidden and the repository's package first on the path."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=path, **env)


def run(command: list[str], timeout: int = 900, **env: str) -> subprocess.CompletedProcess:
    """`command` from the repository root, CUDA hidden, the repository's package first on the path."""
    return subprocess.run(command, cwd=REPO, env=environment(**env), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def script_server(tmp_path_factory):
    """A tests/script_server.py process, from the repository root in `environment()`, for this module's runs."""
    log = tmp_path_factory.mktemp("script_server") / "stderr"
    with log.open("w") as stderr:
        server = subprocess.Popen([sys.executable, str(REPO / "tests" / "script_server.py")], cwd=REPO,
                                  env=environment(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                  text=True)
    yield server, log
    server.stdin.close()
    server.wait(timeout=60)


def run_script(server, arguments: list[str], folder: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGUMENTS...` (`arguments`) run by the script server, its outcome as `run` gives one."""
    process, log = server
    stdout, stderr = folder / "stdout", folder / "stderr"
    process.stdin.write(json.dumps([arguments, str(stdout), str(stderr), timeout]) + "\n")
    process.stdin.flush()
    answer = process.stdout.readline()
    while answer and not answer.startswith("EXIT "):  # (what the server's imports may print)
        answer = process.stdout.readline()
    assert answer.startswith("EXIT "), f"the script server stopped ({answer!r}):\n{log.read_text()[-3000:]}"
    return subprocess.CompletedProcess(arguments, int(answer.split()[1]), stdout.read_text(), stderr.read_text())


def test_every_benchmark_script_has_a_tiny_run():
    scripts = {path.name for path in BENCHMARKS.glob("*.py")}
    assert scripts - NOT_RUN == {script for script, _, _ in RUNS}


@pytest.mark.slow
@pytest.mark.parametrize("script, arguments, expected", RUNS,
                         ids=[" ".join([script, *arguments]) for script, arguments, _ in RUNS])
def test_benchmark_runs_its_tiny_cpu_configuration(script_server, tmp_path, script, arguments, expected):
    start = time.perf_counter()
    done = run_script(script_server, [str(BENCHMARKS / script), *arguments], tmp_path)
    seconds = time.perf_counter() - start
    assert done.returncode == 0, f"exit {done.returncode} after {seconds:.0f} s:\n{done.stdout[-3000:]}\n" \
                                 f"{done.stderr[-3000:]}"
    missing = [text for text in expected if text not in done.stdout]
    assert not missing, f"{missing} not printed:\n{done.stdout[-3000:]}"


def test_verify_step_refuses_fewer_acceptance_lengths_than_mtp_k_values(script_server, tmp_path):
    """A k without its acceptance length would drop its row silently: refused in one line, before the model is built."""
    done = run_script(script_server, [str(BENCHMARKS / "bench_verify_step.py"), "--tiny", "--mtp-k", "1", "2",
                                      "--acceptance", "1.5"], tmp_path)
    assert done.returncode == 2 and "model:" not in done.stdout
    assert "--acceptance gives 1 lengths for 2 --mtp-k values: give one acceptance length per k" in done.stderr


@pytest.mark.parametrize("script", sorted(path.name for path in BENCHMARKS.glob("*.sh")))
def test_shell_script_parses(script):
    done = run(["bash", "-n", str(BENCHMARKS / script)])
    assert done.returncode == 0, done.stderr


def test_gpu_suite_dry_run_names_scripts_that_exist(tmp_path):
    suite = (BENCHMARKS / "gpu_suite.sh").read_text()
    assert 'DRY_RUN:-' in suite  # (without its dry run, the call below would run the suite)
    steps = re.findall(r"^\s+([a-z0-9-]+)\) ", suite, flags=re.MULTILINE)
    assert "generation" in steps and "trace" in steps
    done = run(["bash", str(BENCHMARKS / "gpu_suite.sh"), *steps], timeout=60, DRY_RUN="1", OUT=str(tmp_path))
    assert done.returncode == 0, done.stderr
    for step in steps:
        assert f"=== {step}" in done.stdout, f"step {step} not printed:\n{done.stdout}"
    named = re.findall(r"((?:benchmarks|tests)/[\w/]+\.(?:py|sh))", done.stdout)
    assert named and all((REPO / path).is_file() for path in named), named
    assert list(tmp_path.iterdir()) == []  # nothing ran


@pytest.mark.slow
def test_two_gpu_moe_parallel_dry_run_on_gloo(tmp_path):
    done = run(["bash", str(BENCHMARKS / "two_gpu_moe_parallel.sh"), str(tmp_path)], GLOO="1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "TP_CHECK PASS" in done.stdout, done.stdout[-3000:]
    assert "EP_CHECK PASS" in done.stdout, done.stdout[-3000:]


def bench_trace():
    """benchmarks/bench_trace.py as a module (its helpers; the runs themselves are the subprocess tests above)."""
    sys.path.insert(0, str(BENCHMARKS))
    import bench_trace

    return bench_trace


def test_trace_has_distinct_log_uniform_prompt_lengths_and_repeats_from_its_seed():
    trace = bench_trace().make_trace(200, 16, 16384, 16, 512, seed=0)
    lengths = [request.prompt_length for request in trace]
    assert len(set(lengths)) == 200 and min(lengths) >= 16 and max(lengths) <= 16384
    assert all(16 <= request.new_tokens <= 512 for request in trace)
    assert trace == bench_trace().make_trace(200, 16, 16384, 16, 512, seed=0)
    # log-uniform: half of the draws below the geometric middle, 512 (binomial, sd 7 of 200; uniform draws would
    # put 3% there), and the shortest factor-2 band, [16, 32), holds some (a tenth of the draws; 16 lengths at most)
    assert 70 <= sum(length < 512 for length in lengths) <= 130
    assert sum(length < 32 for length in lengths) >= 5


def test_trace_refuses_more_requests_than_distinct_lengths():
    with pytest.raises(SystemExit, match=r"100 distinct prompt lengths do not fit in \[16, 50\]; ask for at most 35"):
        bench_trace().make_trace(100, 16, 50, 16, 512, seed=0)


def test_trace_left_pads_a_batch():
    ids, mask = bench_trace().left_padded([torch.tensor([5, 6, 7]), torch.tensor([9])])
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def _result(side: str, tok_s: float, ttft: list[float]) -> dict:
    return {"pair": "gdn", "side": side, "way": "single", "tok_s": tok_s, "ttft": ttft, "gaps": [0.01, 0.02],
            "wall_s": 1.0, "worst_ttft": [max(ttft), 99]}


def test_trace_combines_separate_runs_into_one_table_with_ratios(tmp_path, monkeypatch, capsys):
    (tmp_path / "ours.json").write_text(json.dumps([_result("ours", 200.0, [0.1, 0.2])]))
    (tmp_path / "theirs.json").write_text(json.dumps([_result("transformers", 50.0, [0.3, 0.4])]))
    monkeypatch.setattr(sys, "argv", ["bench_trace.py", "--combine", str(tmp_path / "ours.json"),
                                      str(tmp_path / "theirs.json")])
    bench_trace().main()
    ratio_row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("single   ratio"))
    assert ratio_row.split()[2:6] == ["4.00x", "3.00x", "2.00x", "2.00x"]  # tok/s, then TTFT p50 / p90 / p99


def test_trace_joins_the_slices_of_a_run_and_refuses_overlapping_ones(tmp_path, monkeypatch, capsys):
    """Two slices of one (pair, side, way) give one row: their requests' times together, tokens over summed wall
    times; slices that share a request are refused in one line."""
    def part(first: int, end: int, ttft: list[float], tokens: int) -> dict:
        return dict(_result("ours", tokens / 2.0, ttft), slice=[first, end], tokens=tokens, wall_s=2.0)

    (tmp_path / "a.json").write_text(json.dumps([part(0, 2, [0.1, 0.2], 100)]))
    (tmp_path / "b.json").write_text(json.dumps([part(2, 4, [0.3, 0.4], 300)]))
    (tmp_path / "theirs.json").write_text(json.dumps([_result("transformers", 25.0, [0.2, 0.4, 0.6, 0.8])]))
    monkeypatch.setattr(sys, "argv", ["bench_trace.py", "--combine", *(str(tmp_path / n) for n in
                                                                        ("a.json", "b.json", "theirs.json"))])
    bench_trace().main()
    out = capsys.readouterr().out
    assert "gdn ours single: requests 0..1, 2..3 from 2 runs" in out
    ratio_row = next(line for line in out.splitlines() if line.startswith("single   ratio"))
    assert ratio_row.split()[2:4] == ["4.00x", "2.00x"]  # 400 tokens / 4 s against 25 tok/s; TTFT p50 0.4 / 0.2
    (tmp_path / "b.json").write_text(json.dumps([part(1, 4, [0.3, 0.4, 0.5], 300)]))
    with pytest.raises(SystemExit, match=r"overlapping slices of gdn ours single \(\[\(0, 2\), \(1, 4\)\]\)"):
        bench_trace().main()


def test_trace_gives_no_ratios_where_the_sides_played_different_requests(tmp_path, monkeypatch, capsys):
    """A run stopped early (--stop-after) covers fewer requests than the other side: its ratios would compare
    different requests, so the row names the spans instead."""
    (tmp_path / "ours.json").write_text(json.dumps([dict(_result("ours", 200.0, [0.1, 0.2, 0.3]), slice=[0, 3])]))
    (tmp_path / "theirs.json").write_text(json.dumps([dict(_result("transformers", 50.0, [0.3, 0.4]), slice=[0, 2])]))
    monkeypatch.setattr(sys, "argv", ["bench_trace.py", "--combine", str(tmp_path / "ours.json"),
                                      str(tmp_path / "theirs.json")])
    bench_trace().main()
    ratio_row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("single   ratio"))
    assert "not given: the sides played different requests (ours 0..2; transformers 0..1)" in ratio_row


@pytest.mark.parametrize(("text", "message"), [
    ("5", r"--slice takes START:END, two request numbers \(got '5'\)"),
    ("3:3", r"--slice 3:3 is not within the trace's 10 requests: need 0 <= START < END <= 10"),
    ("0:11", r"--slice 0:11 is not within"),
    ("3:8", r"--slice 3:8 starts inside a batch of 2: in the batched way START must be a multiple of --batch"),
])
def test_trace_refuses_a_slice_it_cannot_play(text, message):
    with pytest.raises(SystemExit, match=message):
        bench_trace().parse_slice(text, 10, 2, ["single", "batched"])
    assert bench_trace().parse_slice("3:8", 10, 2, ["single"]) == (3, 8)


def test_trace_refuses_a_file_it_did_not_write_in_one_line(tmp_path, monkeypatch):
    (tmp_path / "other.json").write_text(json.dumps([{"pair": "gdn"}]))
    monkeypatch.setattr(sys, "argv", ["bench_trace.py", "--combine", str(tmp_path / "other.json")])
    with pytest.raises(SystemExit, match=r"other.json is not a --json file of this script \(a result without"):
        bench_trace().main()


def bench_mtp_acceptance():
    """benchmarks/bench_mtp_acceptance.py as a module (its helpers; its run is the subprocess test above)."""
    sys.path.insert(0, str(BENCHMARKS))
    import bench_mtp_acceptance

    return bench_mtp_acceptance


def test_acceptance_split_is_by_file_deterministic_and_disjoint(tmp_path):
    names = [f"m{i:02d}.py" for i in range(25)] + ["pkg/a.py", "site-packages/x.py", "test/t.py", "pkg/tests/u.py",
                                                    "notes.txt"]
    for name in reversed(names):  # (created out of order: the listing sorts)
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    bench = bench_mtp_acceptance()
    files = bench.stdlib_files(tmp_path)
    assert [path.relative_to(tmp_path).as_posix() for path in files] == [f"m{i:02d}.py" for i in range(25)] + [
        "pkg/a.py"]
    train, held = bench.split_files(files)
    assert [path.name for path in held] == ["m09.py", "m19.py"]
    assert set(train).isdisjoint(held) and sorted(train + held) == files
    assert bench.split_files(list(reversed(files))) == (train, held)


def test_acceptance_copy_prompt_and_training_rows():
    bench = bench_mtp_acceptance()
    assert bench.copy_prompt([5, 6, 7, 8], [90, 91], 2) == [5, 6, 7, 8, 90, 91, 5, 6]
    with pytest.raises(ValueError, match=r"lead=4: the copy prompt repeats 1 to 3 tokens of a 4-token chunk"):
        bench.copy_prompt([5, 6, 7, 8], [90], 4)
    stream = torch.arange(2, 202)
    rows = bench.copy_windows(stream, [0, 1], 3, 12, torch.Generator().manual_seed(0))
    assert rows.shape == (3, 12)
    for row in rows.tolist():  # a chunk of 6 consecutive tokens, the instruction, the chunk again (cut at 12)
        assert row[:6] == list(range(row[0], row[0] + 6)) and row[6:8] == [0, 1] and row[8:] == row[:4]
    assert bench.copy_windows(stream, [0, 1], 0, 12, torch.Generator()).shape == (0, 12)


def test_acceptance_counts_the_rounds_that_verify_drafts():
    bench = bench_mtp_acceptance()
    assert bench.verify_rounds([7, 3, 3, 2], prompt=7, new_tokens=9) == (3, 8)  # the prompt's forward: 1 token
    assert bench.verify_rounds([11, 5, 5], prompt=7, new_tokens=14) == (3, 14)  # the prompt's forward drafted too
    assert bench.verify_rounds([1, 4, 4], prompt=7, new_tokens=9) == (2, 8)  # batched: its last position only


@pytest.mark.parametrize("graphs", [False, True])
def test_acceptance_counts_each_round_whose_tokens_the_batched_loop_reads(monkeypatch, graphs):
    """A head that always agrees, k = 3: every round gains 4 tokens, replayed (the capture stood in) or not, with a
    round run ahead of each read (forced on the CPU, as CUDA runs it): that round, whose tokens no row keeps, and the
    capture's runs are not counted, so the acceptance length is 4."""
    from model_helpers import replay_rounds_eagerly, tiny_model
    from test_mtp import _head_that_agrees

    from hybrid_linear_models import speculative_decoding
    from hybrid_linear_models.mtp_drafting import MtpBatchDrafter

    bench = bench_mtp_acceptance()
    monkeypatch.setattr(speculative_decoding, "rounds_ahead", lambda on_device, device: int(on_device))
    if graphs:
        replay_rounds_eagerly(monkeypatch)
    model = tiny_model(["gated_deltanet", "full_attention"], seed=0, num_mtp_layers=1).double()
    _head_that_agrees(model, 1.0)
    ids = torch.randint(2, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), bench.counted_forwards(model) as lengths:
        speculative_decoding.speculative_generate(model, ids, MtpBatchDrafter(model), num_tokens=4,
                                                  max_new_tokens=13, graphs=graphs)
    assert bench.verify_rounds(lengths, prompt=7, new_tokens=13) == (3, 12)  # 12 tokens after the first, 4 a round


def test_acceptance_repetition_counts_new_ngrams_seen_earlier_in_the_row():
    bench = bench_mtp_acceptance()
    looping = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2, 3]])  # prompt 3; new 4-grams from index 0 (0..5): 6, 3 repeated
    assert bench.repeated_ngrams([looping], prompt=3, n=4) == 0.5
    assert bench.repeated_ngrams([torch.arange(10)[None]], prompt=3, n=4) == 0.0


def test_acceptance_copy_measures_the_leading_match_and_the_copied_ngrams():
    bench = bench_mtp_acceptance()
    chunk = [10, 11, 12, 13, 14, 15, 16, 17]
    prompt = [10, 11, 12, 13, 14, 15, 16, 17, 90, 10, 11]  # the chunk, an instruction, its first 2 (lead 2)
    skipping = torch.tensor([prompt + [12, 13, 16, 17, 14, 15]])  # 2 right, then parts out of order
    assert bench.copied_fraction([skipping], [chunk], len(prompt), 2) == 2 / 6
    assert bench.ngrams_from_chunks([skipping], [chunk], len(prompt), n=2) == 3 / 5  # (12 13), (16 17), (14 15)
    exact = torch.tensor([prompt + chunk[2:]])
    assert bench.copied_fraction([exact], [chunk], len(prompt), 2) == 1.0
    assert bench.ngrams_from_chunks([exact], [chunk], len(prompt), n=2) == 1.0


@pytest.mark.parametrize("use_mtp", [1, 3])
def test_acceptance_of_a_head_that_always_agrees_is_every_draft_plus_one(use_mtp):
    """The counting run end to end: each verify round gains use_mtp + 1 tokens; the output is plain greedy's."""
    from test_mtp import _head_that_agrees, _ids, _model

    model = _model()
    _head_that_agrees(model, 1.0)
    bench = bench_mtp_acceptance()
    prompts = [_ids((1, 5), seed=2), _ids((1, 5), seed=3)]
    new_tokens = 1 + 3 * (use_mtp + 1)  # the prompt's token, then three full rounds
    plain = bench.generate_runs(model, prompts, new_tokens)
    drafted = bench.generate_runs(model, prompts, new_tokens, use_mtp=use_mtp)
    assert drafted.acceptance == use_mtp + 1 and (drafted.rounds, drafted.new_tokens) == (6, 2 * new_tokens)
    assert bench.first_difference(drafted.outputs, plain.outputs, 5) == "equal"
    assert plain.acceptance == 1.0
    changed = [plain.outputs[0], plain.outputs[1].clone()]
    changed[1][0, 8] += 1
    assert bench.first_difference(changed, plain.outputs, 5) == "1/2 rows equal (row 1: new token 3)"


def test_acceptance_table_prints_a_failed_configuration_and_goes_on(capsys):
    from test_mtp import _ids, _model

    bench = bench_mtp_acceptance()
    table = bench.Table(_model(), [_ids((1, 5), seed=2)], 4, "copy: ")
    assert not table.speculative("MTP", 5, use_mtp=5)
    assert table.speculative("MTP", 1, use_mtp=1)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| copy: plain | 1 | - |") and lines[1].startswith("| copy: plain, static cache | 1 |")
    assert lines[2] == ("| copy: MTP | 1 | 5 | failed: ValueError: use_mtp must be True or a number of draft tokens "
                        "from 1 to 4, got 5. |")
    assert lines[3].startswith("| copy: MTP | 1 | 1 |") and lines[3].endswith("| equal |")


def test_profile_counts_whole_loop_turns_between_graph_launches():
    """profile_decode_step.loop_turns: the kernels from launch `first` up to the last launch (the last turn's kernels
    may be cut by the profile's end), the turns, and per turn the wall and kernel ms."""
    from types import SimpleNamespace

    sys.path.insert(0, str(BENCHMARKS))
    import profile_decode_step
    from torch.autograd import DeviceType

    def event(device, name, start_us, us=0.0):
        return SimpleNamespace(device_type=device, name=name, time_range=SimpleNamespace(start=start_us),
                               device_time_total=us)

    launches = [event(DeviceType.CPU, "cudaGraphLaunch", t) for t in (0, 1000, 2000, 3000)]
    kernels = [event(DeviceType.CUDA, "k", t, 100.0) for t in (-50, 10, 500, 1010, 2010, 2500, 3010)]
    prof = SimpleNamespace(events=lambda: [*kernels, *launches, event(DeviceType.CPU, "aten::add", 5)])
    count, turns = profile_decode_step.loop_turns(prof, 1)
    assert count == 4 and turns.count == 2 and len(turns.kernels) == 3  # the kernels at 1010, 2010, 2500
    assert turns.wall_ms == pytest.approx(1.0) and turns.busy_ms == pytest.approx(0.15)
    assert profile_decode_step.loop_turns(prof, 3) == (4, None)


def test_trace_gives_ratios_on_the_requests_both_sides_played(tmp_path, monkeypatch, capsys):
    """Runs that keep their generate calls: where one side stopped early, the ratios compare the calls of the
    requests both played (here requests 0..1: tokens over those calls' wall times, their first-token times)."""
    def calls(side: str, spec: list[tuple[int, float, float]]) -> dict:
        base = {"pair": "gdn", "side": side, "way": "single", "slice": [0, len(spec)]}
        return bench_trace().result_of_calls(base, [
            {"first": i, "requests": 1, "wall_s": wall, "tokens": 100, "ttft": ttft, "prompt": 10 + i,
             "gaps": [0.01]} for i, (_, wall, ttft) in enumerate(spec)])

    (tmp_path / "ours.json").write_text(json.dumps([calls("ours", [(0, 1.0, 0.1), (1, 1.0, 0.1), (2, 9.0, 5.0)])]))
    (tmp_path / "theirs.json").write_text(json.dumps([calls("transformers", [(0, 4.0, 0.3), (1, 4.0, 0.3)])]))
    monkeypatch.setattr(sys, "argv", ["bench_trace.py", "--combine", str(tmp_path / "ours.json"),
                                      str(tmp_path / "theirs.json")])
    bench_trace().main()
    ratio_row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("single   ratio"))
    assert ratio_row.split()[2:4] == ["4.00x", "3.00x"]  # 200 tokens / 2 s against 200 / 8 s; TTFT 0.1 vs 0.3
    assert ratio_row.endswith("on requests 0..1, those both sides played")
