"""`LLM.generate` end to end through real actor processes, against transformers' generate().

One LLM per (tp, pp) layout, shared by that layout's tests (class-scoped). Its KV
cache holds 7 blocks of 8 positions whatever the layout, and a batch at most 3
sequences, so the 8 prompts need several batches and force preemption.
"""

from __future__ import annotations

import importlib.util

import json
import os
import platform
import time

import numpy as np
import pytest
import torch

from actors import ActorDied, ConfigError, Fault, FaultPlan
from scheduling import LLM, SamplingParams
from models.prepack import prepack_supported
from scheduling.llm import cpu_plan, default_max_num_batched_tokens, driver_cpus
from tests.conftest import child_pids, wait_gone
from tests.model_checkpoints import PROMPTS, TINY, build_checkpoint, reference_greedy, reference_model

pytestmark = pytest.mark.timeout(300)

BLOCK = 8
NUM_BLOCKS = 7
NEW_TOKENS = 8
MANY_PROMPTS = PROMPTS + [[5, 6, 7, 8, 9, 10], list(range(100, 127)), [250, 3, 250, 3]]
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
# Long prompts among short ones: some steps mix a sequence's first decode row with a long
# prompt chunk, which keeps a boundary layer where it is (models.config.boundary_move).
HEAVY_PROMPTS = MANY_PROMPTS + [list(range(1, 150)), [7, 8] * 60, list(range(300, 400))]


def host_has_glibc() -> bool:
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def kv_bytes_for(num_blocks: int, tp: int, pp: int) -> int:
    """The per-rank budget that gives `num_blocks` blocks on every rank of this layout (float32 TINY)."""
    layers = TINY["num_hidden_layers"] // pp
    kv_heads = max(1, TINY["num_key_value_heads"] // tp)
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    return num_blocks * layers * 2 * BLOCK * kv_heads * head_dim * 4


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The checkpoint, transformers' greedy continuations (no eos), and an eos id that greedy decoding meets.

    The eos written to the checkpoint is a token from the middle of one continuation,
    so that stopping on eos is exercised, not just hoped for.
    """
    path = build_checkpoint(tmp_path_factory.mktemp("llm") / "tiny", seed=3)
    full = reference_greedy(path, MANY_PROMPTS, NEW_TOKENS)
    expected = [seq[len(p) :] for seq, p in zip(full, MANY_PROMPTS)]
    eos = expected[5][4]
    for name in ("config.json", "generation_config.json"):
        file = os.path.join(path, name)
        with open(file) as f:
            config = json.load(f)
        config["eos_token_id"] = eos
        with open(file, "w") as f:
            json.dump(config, f)
    return path, expected, eos


@pytest.fixture(scope="class", params=LAYOUTS, ids=lambda l: f"tp{l[0]}pp{l[1]}")
def llm(request, reference):
    tp, pp = request.param
    with LLM(
        reference[0],
        tp=tp,
        pp=pp,
        kv_cache_bytes=kv_bytes_for(NUM_BLOCKS, tp, pp),
        block_size=BLOCK,
        kv_mirror_bytes=2**22,  # the decode mirror on (its default budget, the tiny cache's, could not hold a batch)
        max_num_seqs=3,
        start_timeout=120.0,
        step_timeout=120.0,
    ) as llm:
        pids = llm.supervisor.pids
        yield llm
    assert not wait_gone(pids), "the gang left processes behind"


class TestLayout:
    """One gang per layout, shared by its tests (class-scoped: gone before the tests below start theirs)."""

    def test_the_engine_loop_and_the_router_run_on_the_driver_cpus(self, llm):
        sup = llm.supervisor
        assert llm.driver_cpus == driver_cpus(cpu_plan(sup.world_size, None), sup.tp_size)
        before = os.sched_getaffinity(0)
        seen = []
        step = llm.engine.step

        def traced_step():
            seen.append(os.sched_getaffinity(0))
            return step()

        llm.engine.step = traced_step
        try:
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
        finally:
            del llm.engine.step
        assert seen and all(cpus == (set(llm.driver_cpus) if llm.driver_cpus else before) for cpus in seen)
        assert os.sched_getaffinity(0) == before  # restored once generate returns
        router = sup._rt.router._thread
        assert os.sched_getaffinity(router.native_id) == set(llm.driver_cpus or before)

    def test_greedy_matches_transformers_across_batches_and_preemption(self, llm, reference):
        _, expected, _ = reference
        before = llm.scheduler.num_preemptions
        llm.engine.get_batch_trace(clear=True)
        counts = llm.engine.stats()
        outputs = llm.generate(MANY_PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        # The engine's timeline holds every batch of the run, each seen back after it was sent.
        trace = llm.engine.get_batch_trace()
        after = llm.engine.stats()
        assert len(trace) == after["num_batches"] - counts["num_batches"]
        assert sum(tokens for *_, tokens in trace) == after["num_tokens"] - counts["num_tokens"]
        assert all(submitted <= seen for _, submitted, seen, _, _ in trace)
        assert any(tokens > chunks for *_, chunks, tokens in trace) and any(tokens == chunks for *_, chunks, tokens in trace)
        assert llm.num_blocks == NUM_BLOCKS and llm.tokenizer is None
        assert [o.token_ids for o in outputs] == expected
        assert [o.prompt_token_ids for o in outputs] == MANY_PROMPTS
        assert all(o.finish_reason == "length" and o.text == "" for o in outputs)
        assert llm.scheduler.num_preemptions > before, "the small KV budget was meant to force preemption"
        assert llm.engine.peak_in_flight == llm.supervisor.pp_size
        assert llm.scheduler.block_manager.num_free_blocks == NUM_BLOCKS
        assert llm.scheduler.max_num_batched_tokens == default_max_num_batched_tokens(llm.supervisor.pp_size)
        # Every rank ran with its linear weights packed and freed memory kept (the CPU defaults).
        stats = llm.supervisor.collective_rpc("get_stats")
        if prepack_supported(torch.float32, "cpu"):
            assert all(s["packed_weights"] > 0 for s in stats)
        assert all(s["keeps_freed_memory"] == host_has_glibc() for s in stats)
        # ... and attended its decode steps with the kernel, built while loading, as were the
        # RMSNorm, rotary and KV write kernels.
        if importlib.util.find_spec("numba") is not None:
            assert all(s["decode_kernel"] and s["norm_rope_kernels"] and s["kv_write_kernel"] for s in stats)
        # With a pipeline the last stage holds the MLP of the layer before its own; both
        # sides of the boundary agreed, step by step, on where it ran.
        pp, tp = llm.supervisor.pp_size, llm.supervisor.tp_size
        if pp > 1:
            lender, last = stats[(pp - 2) * tp : (pp - 1) * tp], stats[(pp - 1) * tp :]
            assert {s["borrowed_mlp"] for s in last} == {last[0]["layers"][0] - 1}
            for key in ("moved_mlp_steps", "moved_attention_steps"):
                assert {s[key] for s in lender} == {s[key] for s in last}

    def test_prompts_chunked_between_decode_steps_match_transformers(self, llm, reference):
        # A budget of 5 tokens splits every prompt over several steps, each sharing its
        # batch with decode rows (the pipeline's default budget does the same at 512).
        _, expected, _ = reference
        scheduler = llm.scheduler
        batches = []

        def schedule():
            batch = type(scheduler).schedule(scheduler)
            if batch is not None:
                batches.append(batch)
            return batch

        budget, scheduler.max_num_batched_tokens = scheduler.max_num_batched_tokens, 5
        scheduler.schedule = schedule  # records what the engine ran
        try:
            outputs = llm.generate(MANY_PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        finally:
            scheduler.max_num_batched_tokens = budget
            del scheduler.schedule
        assert [o.token_ids for o in outputs] == expected
        # At most 5 tokens a batch: every prompt token and every decode row needs its share.
        tokens = sum(len(p) for p in MANY_PROMPTS) + len(MANY_PROMPTS) * (NEW_TOKENS - 1)
        assert len(batches) >= -(-tokens // 5)
        assert max(sum(len(c.token_ids) for c in b.chunks) for b in batches) <= 5
        # Some batch continues a prompt (a chunk past position 0) next to a decode row.
        assert any(
            any(len(c.token_ids) > 1 and c.start_pos > 0 for c in b.chunks)
            and any(len(c.token_ids) == 1 and c.start_pos > 0 for c in b.chunks)
            for b in batches
        )

    def test_decode_rows_mirrored_across_steps_match_transformers(self, llm, reference):
        # Requests ending at different steps leave padding rows in the decode mirror
        # that newcomers take over; every rank's mirror must still give exact attention.
        _, expected, _ = reference
        before = llm.supervisor.collective_rpc("get_stats")
        lengths = [1 + i % NEW_TOKENS for i in range(len(MANY_PROMPTS))][::-1]
        outputs = llm.generate(MANY_PROMPTS, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths])
        assert [o.token_ids for o in outputs] == [ref[:n] for ref, n in zip(expected, lengths)]
        after = llm.supervisor.collective_rpc("get_stats")
        for a, b in zip(before, after):
            assert b["kv_mirror_bytes"] > 0, b["rank"]
            assert b["kv_mirror_fallbacks"] == a["kv_mirror_fallbacks"], b["rank"]
            assert b["kv_mirror_refilled_rows"] > a["kv_mirror_refilled_rows"], b["rank"]

    def test_stop_tokens_and_max_tokens_are_honoured(self, llm, reference):
        _, expected, _ = reference
        stop = expected[0][3]
        params = [
            SamplingParams(max_tokens=NEW_TOKENS, stop_token_ids=[stop], ignore_eos=True),
            SamplingParams(max_tokens=3, ignore_eos=True),
        ]
        outputs = llm.generate(MANY_PROMPTS[:2], params)
        assert outputs[0].token_ids == expected[0][: expected[0].index(stop) + 1] and outputs[0].finish_reason == "stop"
        assert outputs[1].token_ids == expected[1][:3] and outputs[1].finish_reason == "length"


    def test_eos_stops_like_transformers_generate(self, llm, reference):
        path, expected, eos = reference
        outputs = llm.generate(MANY_PROMPTS, SamplingParams(max_tokens=NEW_TOKENS))
        for out, ref in zip(outputs, expected):
            stops = eos in ref
            assert out.token_ids == (ref[: ref.index(eos) + 1] if stops else ref)
            assert out.finish_reason == ("stop" if stops else "length")
        prompt = MANY_PROMPTS[5]
        with torch.no_grad():
            ids = torch.tensor([prompt])
            hf = reference_model(path).generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos
            )
        assert outputs[5].token_ids == hf[0, len(prompt) :].tolist()


    def test_greedy_rows_next_to_sampled_rows_match_transformers(self, llm, reference):
        # Under tp a step of greedy rows only takes the shard-argmax path, one with any
        # sampled or logprob row gathers full logits: both run here, step after step.
        _, expected, _ = reference
        greedy = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
        greedy_logprobs = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)
        sampled = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=5, ignore_eos=True)
        params = [greedy, sampled, greedy_logprobs, greedy, sampled, greedy, greedy, greedy]
        outputs = llm.generate(MANY_PROMPTS, params)
        for i, (out, p) in enumerate(zip(outputs, params)):
            if p is not sampled:
                assert out.token_ids == expected[i], f"prompt {i}"
        assert len(outputs[2].logprobs) == NEW_TOKENS and max(outputs[2].logprobs) <= 0
        assert [o.token_ids for o in llm.generate(MANY_PROMPTS[:2], greedy)] == expected[:2]

    def test_seeded_sampling_is_the_same_with_and_without_preemption(self, llm):
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=11, ignore_eos=True, logprobs=True)
        together = llm.generate(MANY_PROMPTS, params)
        alone = [llm.generate([p], params)[0] for p in MANY_PROMPTS]
        assert [o.token_ids for o in together] == [o.token_ids for o in alone]
        assert all(len(o.logprobs) == len(o.token_ids) and max(o.logprobs) <= 0 for o in together)


    def test_bad_input_is_refused_before_anything_runs(self, llm):
        with pytest.raises(ValueError, match="no tokenizer"):
            llm.generate(["text needs a tokenizer"])
        with pytest.raises(ValueError, match="outside"):
            llm.generate([[1, 999]])
        with pytest.raises(ValueError, match="one per prompt"):
            llm.generate([[1], [2]], [SamplingParams()])
        with pytest.raises(TypeError, match="token ids must be integers.*1.5"):
            llm.generate([[1, 1.5]])  # not silently token 1
        with pytest.raises(TypeError, match="token ids must be integers.*'7'"):
            llm.generate([[1, 2], [3, "7"]])
        with pytest.raises(TypeError, match="a prompt must be a string or a list of token ids, got float"):
            llm.generate([[1, 2], 3.5])
        with pytest.raises(TypeError, match="prompts must be .* got NoneType"):
            llm.generate(None)
        assert not llm.engine.has_unfinished()

    def test_token_ids_may_come_as_a_tensor_or_an_array(self, llm, reference):
        _, expected, _ = reference
        params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
        # One 1-D tensor is one prompt; a list of numpy arrays, one prompt each.
        one = llm.generate(torch.tensor(MANY_PROMPTS[0]), params)
        many = llm.generate([np.array(p, dtype=np.int64) for p in MANY_PROMPTS[:2]], params)
        assert [o.token_ids for o in one + many] == [expected[0], expected[0], expected[1]]


@pytest.mark.parametrize(
    "cpus, plan, tp, want",
    [
        ({0, 1}, None, 1, None),  # ranks not pinned
        ({0, 1}, [[0], [1]], 1, [0]),  # PP2: the first stage's CPU
        ({0, 1}, [[0], [1]], 2, None),  # TP2: one stage, every CPU busy at once
        ({0, 1}, [[0, 1]], 1, None),  # one rank on both CPUs
        ({0, 1}, [[0]], 1, [1]),  # a CPU no rank uses
        ({0, 1, 2, 3}, [[0], [1], [2], [3]], 2, [0, 1]),  # TP2xPP2: the first stage's ranks
        ({0, 1, 2, 3, 4}, [[0], [1], [2], [3]], 2, [4]),
    ],
)
def test_driver_cpus_follow_the_plan(monkeypatch, cpus, plan, tp, want):
    monkeypatch.setattr("scheduling.llm.os.sched_getaffinity", lambda pid: set(cpus))
    assert driver_cpus(plan, tp) == want


@pytest.mark.parametrize(
    "sizes", [dict(tp=0), dict(pp=0), dict(tp=-1), dict(pp=1.5), dict(tp=True), dict(num_threads=0)]
)
def test_a_parallel_size_below_one_or_not_an_integer_is_a_config_error(sizes):
    # Refused before any process starts (the CPU plan divides by tp * pp).
    name, value = next(iter(sizes.items()))
    with pytest.raises(ConfigError, match=rf"{name} must be an integer >= 1, got {value!r}"):
        LLM(**sizes)
    assert not child_pids()


@pytest.mark.parametrize("workers", [-1, 1.5, "2"])
def test_compile_workers_below_zero_or_not_an_integer_is_a_config_error(workers):
    with pytest.raises(ConfigError, match=rf"compile_workers must be an integer >= 0, got {workers!r}"):
        LLM(compile_workers=workers)
    assert not child_pids()


def test_default_model_with_text_prompts():
    """model=None builds/loads the built-in checkpoint with its tokenizer; text round-trips through it."""
    with LLM(kv_cache_bytes=16 * 2**20, start_timeout=120.0) as llm:
        pids = llm.supervisor.pids
        prompts = ["Hello, how are you?", "The capital of France is"]
        outputs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=True)
        tok = llm.tokenizer
        for prompt, out in zip(prompts, outputs):
            assert out.prompt_token_ids == tok.encode(prompt)
            assert len(out.token_ids) == 4 and out.finish_reason == "length"
            assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
        single = llm.generate(prompts[0], SamplingParams(max_tokens=4, ignore_eos=True))
        assert [o.token_ids for o in single] == [outputs[0].token_ids]
    assert not wait_gone(pids) and not child_pids()


@pytest.mark.parametrize(
    "tp, attention, shm", [(1, True, True), (2, True, False), (1, False, True)], ids=["layer", "layer-tp2-gloo", "mlp"]
)
def test_the_boundary_layer_moved_across_stages_changes_no_token(reference, tp, attention, shm):
    """Split (3, 1), stage 0 is the busier: the last stage runs layer 2 (all but its keys and
    values, or its MLP only) on prompt-heavy steps; tokens stay transformers'."""
    path, expected, _ = reference
    with LLM(
        path, tp=tp, pp=2, block_size=BLOCK, layer_split=(3, 1), move_boundary_attention=attention,
        shm_handoff=shm, start_timeout=120.0,
    ) as llm:
        pids = llm.supervisor.pids
        outputs = llm.generate(MANY_PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        assert [o.token_ids for o in outputs] == expected
        stats = llm.supervisor.collective_rpc("get_stats")
        assert [s["borrowed_mlp"] for s in stats] == [None] * tp + [2] * tp
        assert [s["borrowed_attention"] for s in stats] == [False] * tp + [attention] * tp
        # On CPU the hidden states went through the shared-memory rings (models/shm_handoff.py).
        way = "shm" if shm else "dist"
        assert [(s["handoff_in"], s["handoff_out"]) for s in stats] == [(None, way)] * tp + [(way, None)] * tp
        moved = {(s["moved_mlp_steps"], s["moved_attention_steps"]) for s in stats}
        assert len(moved) == 1
        mlp_steps, attention_steps = moved.pop()
        assert mlp_steps > 0 and (attention_steps > 0) == attention
    assert not wait_gone(pids) and not child_pids()


@pytest.fixture(scope="module")
def heavy_head(tmp_path_factory):
    """A checkpoint whose LM head (vocab 1024) makes the last of two (2, 2) stages the busier on
    decode steps, and transformers' greedy continuations of HEAVY_PROMPTS (no eos)."""
    path = build_checkpoint(tmp_path_factory.mktemp("llm") / "heavy-head", seed=5, vocab_size=1024)
    full = reference_greedy(path, HEAVY_PROMPTS, NEW_TOKENS)
    return path, [seq[len(p) :] for seq, p in zip(full, HEAVY_PROMPTS)]


@pytest.mark.parametrize(
    "tp, split, shm, back, kv_bytes",
    [
        (1, (2, 2), True, True, 9 * 2**14),
        (2, (2, 2), True, True, None),
        (1, (2, 1, 1), True, True, None),
        (1, (2, 2), False, True, None),
        (1, (2, 2), True, False, None),
    ],
    ids=["tp1-preempted", "tp2", "pp3", "gloo", "off"],
)
def test_attention_moved_back_to_the_stage_before_changes_no_token(heavy_head, tp, split, shm, back, kv_bytes):
    """Decode steps run the last stage's first attention half on the stage before (its keys go
    forward), prompt-heavy steps run it on the last stage (its keys come back through the ring):
    tokens stay transformers', with two batches in flight, with requests preempted and
    recomputed, and with three stages. A 16-token budget chunks the long prompts, so sequences
    often take their first decode step beside a prompt chunk, with the layer on the last stage.
    Without the shared-memory rings (gloo), or with move_boundary_back=False, the copy is not
    kept and nothing moves back."""
    path, expected = heavy_head
    pp = len(split)
    options = {"kv_cache_bytes": kv_bytes} if kv_bytes else {}
    with LLM(
        path, tp=tp, pp=pp, block_size=BLOCK, layer_split=split, max_num_seqs=3, shm_handoff=shm,
        move_boundary_back=back, max_num_batched_tokens=16, start_timeout=120.0, **options,
    ) as llm:
        pids = llm.supervisor.pids
        outputs = llm.generate(HEAVY_PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        assert [o.token_ids for o in outputs] == expected
        assert llm.engine.peak_in_flight == pp
        if kv_bytes:
            assert llm.engine.stats()["num_preemptions"] > 0
        stats = llm.supervisor.collective_rpc("get_stats")
        kept = shm and back
        lender = sum(split[:-1])  # the last stage's first layer
        borrowers = [None] * tp * (pp - 2) + [lender if kept else None] * tp + [None] * tp
        assert [s["borrowed_next"] for s in stats] == borrowers
        last_two = stats[-2 * tp :]
        moved = {(s["moved_back_steps"], s["writeback_steps"]) for s in last_two}
        assert len(moved) == 1  # every rank of both stages decided alike
        moved_back, writebacks = moved.pop()
        assert (moved_back > 0 and writebacks > 0) if kept else moved_back == writebacks == 0
    assert not wait_gone(pids) and not child_pids()


def test_plain_weights_and_default_malloc_give_the_same_tokens(reference):
    """prepack_weights, keep_freed_memory, decode_kernel, move_boundary_mlp, shm_handoff, norm_rope_kernels and
    kv_write_kernel off reach every rank and change no token."""
    path, expected, _ = reference
    with LLM(
        path, tp=2, pp=2, block_size=BLOCK, prepack_weights=False, keep_freed_memory=False, decode_kernel=False,
        move_boundary_mlp=False, shm_handoff=False, norm_rope_kernels=False, kv_write_kernel=False, start_timeout=120.0,
    ) as llm:
        pids = llm.supervisor.pids
        stats = llm.supervisor.collective_rpc("get_stats")
        assert [
            (s["packed_weights"], s["keeps_freed_memory"], s["decode_kernel"], s["norm_rope_kernels"], s["kv_write_kernel"])
            for s in stats
        ] == [(0, False, False, False, False)] * 4
        assert [(s["handoff_in"], s["handoff_out"]) for s in stats] == [(None, "dist")] * 2 + [("dist", None)] * 2
        outputs = llm.generate(MANY_PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        assert [o.token_ids for o in outputs] == expected
        stats = llm.supervisor.collective_rpc("get_stats")
        assert [(s["borrowed_mlp"], s["moved_mlp_steps"]) for s in stats] == [(None, 0)] * 4
    assert not wait_gone(pids) and not child_pids()


def test_a_crash_with_restart_policy_loses_no_request(reference):
    """A stage-1 rank is SIGKILLed mid-run: the gang restarts, the engine recomputes, greedy output is unchanged."""
    path, expected, _ = reference
    plan = FaultPlan([Fault((1, 0), "execute_model", at_call=4, action="crash")])
    with LLM(
        path, tp=1, pp=2, block_size=BLOCK, max_num_seqs=3, policy="restart", fault_plan=plan, start_timeout=120.0
    ) as llm:
        outputs = llm.generate(MANY_PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        assert [o.token_ids for o in outputs] == expected
        assert llm.supervisor.epoch == 1 and llm.engine.stats()["num_recoveries"] == 1
        pids = llm.supervisor.pids
    assert not wait_gone(pids) and not child_pids()


def test_a_crash_with_fail_policy_raises_naming_the_rank(reference):
    path, _, _ = reference
    plan = FaultPlan([Fault((0, 0), "execute_model", at_call=3, action="crash")])
    with LLM(path, tp=1, pp=2, block_size=BLOCK, max_num_seqs=3, fault_plan=plan, start_timeout=120.0) as llm:
        pids = llm.supervisor.pids
        start = time.monotonic()
        with pytest.raises(ActorDied) as info:
            llm.generate(MANY_PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        assert info.value.rank == (0, 0) and time.monotonic() - start < 30
        assert not llm.engine.has_unfinished()
    assert not wait_gone(pids) and not child_pids()
