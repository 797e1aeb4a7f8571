"""The Llama forward at TP1xPP1, in process, against transformers."""

from __future__ import annotations

import json
import os

import pytest
import torch

import models.config
from models import bf16_gemm, prompt_attention
from actors.context import ActorContext
from models.batch import ModelBatch, SequenceChunk
from models.config import (
    HEAD_MAC_COST,
    BoundaryMove,
    PROMPT_TOKEN_COST,
    Layout,
    LlamaArgs,
    ModelConfigError,
    check_layout,
    layer_matmul_macs,
    boundary_move,
    lm_head_layers,
    load_config,
    split_layers,
)
from models.kv_cache import PagedKVCache
from models.llama import rope_inv_freq
from models.loader import load_stage
from models.step import BatchError, prepare_step
from models.worker import LlamaWorker
from tests.model_checkpoints import (
    LLAMA3_ROPE,
    PROMPTS,
    TINY,
    block_tables,
    build_checkpoint,
    prefill_batch,
    reference_greedy,
    reference_last_logits,
    run_greedy,
)

pytestmark = pytest.mark.timeout(120)

BLOCK = 8
NEW_TOKENS = 8
KV_BYTES = 2**20


def single_rank() -> ActorContext:
    return ActorContext(pp=0, tp=0, tp_size=1, pp_size=1, master_addr="127.0.0.1", master_port=0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "single": build_checkpoint(root / "single"),
        "sharded": build_checkpoint(root / "sharded", seed=1, max_shard_size="100KB"),
        "tied": build_checkpoint(root / "tied", seed=2, tie_word_embeddings=True),
        "llama3": build_checkpoint(root / "llama3", seed=3, **LLAMA3_ROPE),
    }


@pytest.fixture(scope="module")
def workers(checkpoints):
    """One loaded single-rank worker per checkpoint, built on first use."""
    built: dict[str, LlamaWorker] = {}

    def get(name: str) -> LlamaWorker:
        if name not in built:
            worker = LlamaWorker(single_rank(), model=checkpoints[name], kv_cache_bytes=KV_BYTES, block_size=BLOCK)
            worker.load_model()
            built[name] = worker
        return built[name]

    yield get
    for worker in built.values():
        worker.shutdown()


@pytest.mark.parametrize("name", ["single", "sharded", "tied", "llama3"])
def test_greedy_tokens_match_transformers_generate(checkpoints, workers, name):
    got = run_greedy(workers(name).execute_model, PROMPTS, NEW_TOKENS, BLOCK)
    assert got == reference_greedy(checkpoints[name], PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("name", ["single", "tied", "llama3"])
def test_last_position_logits_match_transformers(checkpoints, workers, name):
    tables = block_tables([len(p) for p in PROMPTS], BLOCK)
    logits = workers(name).compute_logits(prefill_batch(PROMPTS, tables))
    expected = reference_last_logits(checkpoints[name], PROMPTS)
    assert logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_chunked_prefill_matches_one_shot_prefill(checkpoints, workers):
    worker, prompt = workers("single"), PROMPTS[4]
    table = block_tables([len(prompt)], BLOCK)[0]
    split = 11  # not on a block boundary
    first = ModelBatch(0, [SequenceChunk(0, prompt[:split], 0, table, sample=False)])
    assert worker.compute_logits(first) is None
    rest = ModelBatch(1, [SequenceChunk(0, prompt[split:], split, table)])
    expected = reference_last_logits(checkpoints["single"], [prompt])
    torch.testing.assert_close(worker.compute_logits(rest), expected, atol=1e-4, rtol=0)


def test_batch_mixing_prefill_and_decode_matches_transformers(checkpoints, workers):
    worker = workers("single")
    decoding, fresh = PROMPTS[2], PROMPTS[0]
    tables = block_tables([len(decoding) + 1, len(fresh)], BLOCK)
    worker.execute_model(ModelBatch(0, [SequenceChunk(0, decoding[:-1], 0, tables[0], sample=False)]))
    mixed = ModelBatch(
        1,
        [
            SequenceChunk(1, fresh, 0, tables[1]),
            SequenceChunk(0, decoding[-1:], len(decoding) - 1, tables[0]),
        ],
    )
    expected = reference_last_logits(checkpoints["single"], [fresh, decoding])
    torch.testing.assert_close(worker.compute_logits(mixed), expected, atol=1e-4, rtol=0)


def test_output_lists_only_chunks_that_sample(workers):
    worker = workers("single")
    tables = block_tables([4, 4, 4], BLOCK)
    batch = ModelBatch(
        7,
        [
            SequenceChunk(10, [1, 2, 3], 0, tables[0]),
            SequenceChunk(11, [4, 5], 0, tables[1], sample=False),
            SequenceChunk(12, [6], 0, tables[2]),
        ],
    )
    out = worker.execute_model(batch)
    assert (out.batch_id, out.seq_ids, len(out.token_ids), out.logprobs) == (7, [10, 12], 2, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_matches_transformers_in_every_dtype(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from models.llama import RMSNorm

    torch.manual_seed(0)
    ours, theirs = RMSNorm(96, eps=1e-5), LlamaRMSNorm(96, eps=1e-5)
    weight = torch.randn(96)
    ours.weight.data, theirs.weight.data = weight.clone(), weight.clone()
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    x = (torch.randn(37, 96) * 3).to(dtype)
    with torch.inference_mode():
        got, want = ours(x), theirs(x)
    assert got.dtype == dtype
    # The same roundings in the same order; the float32 scale (summed in another order) may
    # differ in its last bit, which moves a rare low-precision result by one unit in the last place.
    # In float32 the multiplications' order differs too: a few units in the last place.
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=0, rtol=1e-6)
    else:
        torch.testing.assert_close(got, want, atol=0, rtol=torch.finfo(dtype).eps)
        assert (got == want).float().mean() > 0.99


def test_llama3_inv_freq_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(**{**LLAMA3_ROPE, "rope_scaling": dict(LLAMA3_ROPE["rope_scaling"])})
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    got = rope_inv_freq(LlamaArgs.from_hf(config))
    assert torch.equal(got, expected)
    # The scaling must actually change something at this config, or the greedy test proves little.
    plain = rope_inv_freq(LlamaArgs.from_dict({**TINY, "rope_theta": LLAMA3_ROPE["rope_theta"]}))
    assert not torch.equal(got, plain)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"rope_theta": 50000.0, "head_dim": 32},
        {"num_key_value_heads": None},
        {"rope_scaling": {"type": "linear", "factor": 2.0}},
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
    ],
)
def test_config_json_reads_like_transformers(tmp_path, extra):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    raw = {**TINY, **extra, "model_type": "llama"}
    raw = {k: v for k, v in raw.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours = load_config(tmp_path)
    theirs = LlamaConfig.from_pretrained(tmp_path)
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rope_type == theirs.rope_parameters["rope_type"]
    assert torch.equal(rope_inv_freq(ours), LlamaRotaryEmbedding(theirs).inv_freq)


def test_unsupported_rope_type_is_rejected():
    with pytest.raises(ModelConfigError, match="rope_type 'yarn'"):
        LlamaArgs.from_dict({**TINY, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


@pytest.mark.parametrize(
    "config, tp_size, message",
    [
        (dict(num_attention_heads=4), 8, "tp_size=8 is larger than num_attention_heads=4"),
        (dict(num_attention_heads=6, num_key_value_heads=6, hidden_size=48), 4, "not divisible by tp_size=4"),
        (dict(num_attention_heads=8, num_key_value_heads=4), 8, None),  # kv heads replicated: fine
        (dict(num_attention_heads=12, num_key_value_heads=4, hidden_size=48), 6, "num_key_value_heads=4"),
    ],
)
def test_layout_check_names_the_rank(config, tp_size, message):
    args = LlamaArgs.from_dict({**TINY, **config})
    layout = Layout(args, tp=1, tp_size=tp_size, pp=0, pp_size=1)
    if message is None:
        check_layout(layout)
        return
    with pytest.raises(ModelConfigError) as info:
        check_layout(layout)
    assert "rank (pp=0, tp=1)" in str(info.value) and message in str(info.value)


def test_kv_heads_fewer_than_tp_are_replicated_to_the_ranks_that_use_them():
    args = LlamaArgs.from_dict({**TINY, "num_attention_heads": 8, "num_key_value_heads": 2})
    layouts = [Layout(args, tp=t, tp_size=4) for t in range(4)]
    assert [lay.q_heads for lay in layouts] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # Query heads 0-3 use kv head 0, heads 4-7 kv head 1.
    assert [lay.kv_heads for lay in layouts] == [(0, 1), (0, 1), (1, 2), (1, 2)]


def test_layers_split_balanced_or_as_given():
    assert split_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert split_layers(7, 2, [2, 5]) == [range(0, 2), range(2, 7)]
    with pytest.raises(ModelConfigError, match="summing to num_hidden_layers=7"):
        split_layers(7, 2, [2, 4])
    with pytest.raises(ModelConfigError, match="pp_size=3 is larger than num_hidden_layers=2"):
        split_layers(2, 3)


def test_default_split_counts_the_lm_head_as_layers_on_the_last_stage():
    # Cost of the busiest stage first: with the head worth 3.2 layers, (6, 2) costs
    # max(6, 5.2) against max(5, 6.2) for (5, 3) and max(4, 7.2) for the equal split.
    assert split_layers(8, 2, last_stage_extra=3.2) == [range(0, 6), range(6, 8)]
    assert split_layers(8, 4, last_stage_extra=3.2) == [range(0, 3), range(3, 5), range(5, 7), range(7, 8)]
    assert split_layers(8, 2, last_stage_extra=100.0) == [range(0, 7), range(7, 8)]
    assert split_layers(8, 2, last_stage_extra=0.5) == [range(0, 4), range(4, 8)]
    # An explicit layer_split wins over the cost model.
    assert split_layers(8, 2, [4, 4], last_stage_extra=3.2) == [range(0, 4), range(4, 8)]


def test_lm_head_weighs_its_matmul_against_a_layer_per_sampled_token():
    # The default model's shape: hidden 512, 8 heads of 64, 4 kv heads, intermediate 1408, vocab 32000.
    shape = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=4, intermediate_size=1408)
    args = LlamaArgs.from_dict({**TINY, **shape, "vocab_size": 32000, "num_hidden_layers": 8})
    assert layer_matmul_macs(args) == 512 * (2 * 512 + 2 * 256) + 3 * 512 * 1408
    head_macs = 512 * 32000 / layer_matmul_macs(args)
    # Decode only: the head's multiply-adds at their measured relative cost.
    assert lm_head_layers(args, tokens_per_sample=1.0) == pytest.approx(head_macs * HEAD_MAC_COST)
    # Each sampled token also brings prompt tokens through the layers, which make the head weigh less.
    assert lm_head_layers(args, tokens_per_sample=3.0) == pytest.approx(
        head_macs * HEAD_MAC_COST / (1 + 2 * PROMPT_TOKEN_COST)
    )
    assert lm_head_layers(args) == pytest.approx(2.17, abs=0.01)  # chat traffic: 1.75 tokens per sample
    assert [len(r) for r in Layout(args, pp_size=2).stage_layers] == [5, 3]
    assert [len(r) for r in Layout(args, pp_size=2, layer_split=(4, 4)).stage_layers] == [4, 4]


def default_model_args(**extra) -> LlamaArgs:
    shape = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=4, intermediate_size=1408)
    return LlamaArgs.from_dict({**TINY, **shape, "vocab_size": 32000, "num_hidden_layers": 8, **extra})


def test_the_boundary_mlp_moves_to_the_last_stage_on_prompt_heavy_steps():
    # The default model at PP2 splits (5, 3): balanced for decode, where the last stage's
    # head is worth ~2.8 layers a row, so a decode step keeps the MLP where it is.
    layouts = [Layout(default_model_args(), pp=s, pp_size=2, move_boundary_mlp=True) for s in (0, 1)]
    first, last = layouts
    assert first.lends_mlp and first.borrowed_mlp is None
    assert last.borrowed_mlp == 4 and not last.lends_mlp
    assert boundary_move(first, num_tokens=32, num_decode_rows=32, num_sampled=32) == BoundaryMove.NONE
    assert boundary_move(first, num_tokens=1, num_decode_rows=1, num_sampled=1) == BoundaryMove.NONE
    # A 512-token prompt chunk sampling 4 rows leaves the last stage short of work: moved.
    assert boundary_move(first, num_tokens=512, num_decode_rows=0, num_sampled=4) == BoundaryMove.MLP
    assert boundary_move(last, num_tokens=512, num_decode_rows=0, num_sampled=0) == BoundaryMove.MLP
    # Mixed: 32 decode rows with 128 prompt tokens still favour the move; 480 rows with 32 do not.
    assert boundary_move(first, num_tokens=160, num_decode_rows=32, num_sampled=33) == BoundaryMove.MLP
    assert boundary_move(first, num_tokens=512, num_decode_rows=480, num_sampled=481) == BoundaryMove.NONE
    # Holding the whole layer, a prompt-heavy step moves all of it but its keys and values;
    # a decode step still moves nothing.
    whole = [Layout(default_model_args(), pp=s, pp_size=2, move_boundary_mlp=True, move_boundary_attention=True)
             for s in (0, 1)]
    assert whole[0].lends_attention and whole[1].borrows_attention and not whole[1].lends_attention
    assert whole[1].cache_layers == [5, 6, 7, 4] and whole[0].cache_layers == [0, 1, 2, 3, 4]
    for lay in whole:
        assert boundary_move(lay, 512, 0, 4) == BoundaryMove.LAYER
        assert boundary_move(lay, 512, 20, 24) == BoundaryMove.LAYER  # the workload's prompt steps
        assert boundary_move(lay, 32, 32, 32) == BoundaryMove.NONE
    assert boundary_move(first, 512, 0, 4) == BoundaryMove.MLP  # the MLP alone where only it is held
    # With a 4 + 4 split the last stage would keep more layers than any other (and the KV
    # cache, sized by the largest stage, fewer blocks): only the MLP may move there.
    even = [Layout(default_model_args(), pp=s, pp_size=2, layer_split=(4, 4), move_boundary_mlp=True,
                   move_boundary_attention=True) for s in (0, 1)]
    assert not even[0].lends_attention and not even[1].borrows_attention and even[1].borrowed_mlp == 3
    assert even[1].cache_layers == [4, 5, 6, 7]
    assert boundary_move(even[0], 512, 0, 4) != BoundaryMove.LAYER
    # Off, or with one stage, nothing moves and no stage holds a copy.
    off = Layout(default_model_args(), pp=1, pp_size=2)
    assert off.borrowed_mlp is None and boundary_move(off, 512, 0, 4) == BoundaryMove.NONE
    one = Layout(default_model_args(), move_boundary_mlp=True)
    assert one.borrowed_mlp is None and not one.lends_mlp and boundary_move(one, 512, 0, 4) == BoundaryMove.NONE
    # With more stages only the last boundary moves.
    four = [Layout(default_model_args(), pp=s, pp_size=4, move_boundary_mlp=True) for s in range(4)]
    assert [lay.lends_mlp for lay in four] == [False, False, True, False]
    assert [lay.borrowed_mlp for lay in four] == [None, None, None, four[3].layers.start - 1]


@pytest.mark.parametrize("attention", [False, True], ids=["mlp-only", "whole-layer"])
def test_the_boundary_layer_gives_the_same_logits_wherever_it_runs(checkpoints, attention):
    """Two in-process stages, the second holding the first's last layer (its MLP, or all of it).

    For every pair of moves, a prompt step and then a decode step: the prompt logits are
    transformers', and so are the decode step's, which reads the keys and values the
    prompt step left in the boundary layer's cache on whichever stage attends it.
    """
    path = checkpoints["single"]
    args = load_config(path)
    # (3, 1): the last stage keeps no more layers than the first even with the borrowed one.
    layouts = [
        Layout(args, pp=s, pp_size=2, layer_split=(3, 1), move_boundary_mlp=True, move_boundary_attention=attention)
        for s in (0, 1)
    ]
    stages = [load_stage(lay, path, torch.float32)[0] for lay in layouts]
    boundary = layouts[0].layers[-1]
    borrowed = stages[1].layers[str(boundary)]
    assert stages[1].borrowed_mlp == boundary and (borrowed.self_attn is not None) == attention
    assert layouts[1].cache_layers == list(layouts[1].layers) + ([boundary] if attention else [])
    assert layouts[0].lends_attention == layouts[1].borrows_attention == attention
    moves = [BoundaryMove.NONE, BoundaryMove.MLP] + ([BoundaryMove.LAYER] if attention else [])

    tables = block_tables([len(p) + 1 for p in PROMPTS], BLOCK)
    expected = reference_last_logits(path, PROMPTS)
    first = expected.argmax(-1).tolist()
    decode = ModelBatch(1, [SequenceChunk(i, [first[i]], len(p), tables[i]) for i, p in enumerate(PROMPTS)])
    expected_next = reference_last_logits(path, [[*p, first[i]] for i, p in enumerate(PROMPTS)])
    handed = {}
    for prompt_move in moves:
        for decode_move in moves:
            caches = [
                PagedKVCache(
                    lay.cache_layers, 64, BLOCK, lay.num_local_kv_heads, args.head_dim, torch.float32, "cpu",
                    mirror_bytes=2**20,
                )
                for lay in layouts
            ]
            logits = []
            for batch, move in ((prefill_batch(PROMPTS, tables), prompt_move), (decode, decode_move)):
                step = prepare_step(batch, block_size=BLOCK, num_blocks=64, vocab_size=args.vocab_size)
                kv = torch.empty(step.num_tokens, 2, layouts[0].num_local_kv_heads, args.head_dim) if attention else None
                with torch.inference_mode():
                    h = stages[0](step.token_ids, step, caches[0], move=move, boundary_kv=kv)
                    if batch.batch_id == 0:
                        handed[move] = h.clone()
                    h = stages[1](h, step, caches[1], move=move, boundary_kv=kv)
                    logits.append(stages[1].compute_logits(h[step.sample_rows]))
            torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=0)
            torch.testing.assert_close(logits[1], expected_next, atol=1e-4, rtol=0)
    # What crosses the boundary differs (the stage stopped at a different point), the result does not.
    for a in moves:
        for b in moves:
            assert a == b or not torch.allclose(handed[a], handed[b])


def test_a_move_the_stages_cannot_make_is_refused(checkpoints):
    path = checkpoints["single"]
    args = load_config(path)
    mlp_only = [Layout(args, pp=s, pp_size=2, move_boundary_mlp=True) for s in (0, 1)]
    stages = [load_stage(lay, path, torch.float32)[0] for lay in mlp_only]
    cache = PagedKVCache(mlp_only[1].cache_layers, 8, BLOCK, 2, args.head_dim, torch.float32)
    step = prepare_step(prefill_batch(PROMPTS[:1], [[0, 1]]), block_size=BLOCK, num_blocks=8, vocab_size=args.vocab_size)
    h = torch.zeros(step.num_tokens, args.hidden_size)
    with pytest.raises(ValueError, match="holds only the boundary MLP"), torch.inference_mode():
        stages[1](h, step, cache, move=BoundaryMove.LAYER)
    with pytest.raises(ValueError, match="needs boundary_kv"), torch.inference_mode():
        stages[0](step.token_ids, step, PagedKVCache(mlp_only[0].cache_layers, 8, BLOCK, 2, args.head_dim, torch.float32),
                  move=BoundaryMove.LAYER)


def test_kv_cache_holds_as_many_blocks_as_the_budget_allows(checkpoints):
    budget = 300_000
    worker = LlamaWorker(single_rank(), model=checkpoints["single"], kv_cache_bytes=budget, block_size=BLOCK)
    info = worker.load_model()
    per_block = PagedKVCache.bytes_per_block(TINY["num_hidden_layers"], BLOCK, 2, 16, torch.float32)
    assert info["num_blocks"] == budget // per_block
    assert info["block_size"] == BLOCK
    assert info["kv_cache_bytes"] <= budget
    worker.shutdown()


def test_kv_budget_below_one_block_is_rejected(checkpoints):
    worker = LlamaWorker(single_rank(), model=checkpoints["single"], kv_cache_bytes=100, block_size=BLOCK)
    with pytest.raises(ModelConfigError, match=r"rank \(pp=0, tp=0\): kv_cache_bytes=100 is less than one KV block"):
        worker.load_model()


def test_a_negative_mirror_budget_is_rejected(checkpoints):
    with pytest.raises(ModelConfigError, match=r"rank \(pp=0, tp=0\): kv_mirror_bytes must be >= 0, got -1"):
        LlamaWorker(single_rank(), model=checkpoints["single"], kv_mirror_bytes=-1)


def test_block_table_too_short_is_a_batch_error(workers):
    batch = ModelBatch(3, [SequenceChunk(5, list(range(1, 12)), 0, [0])])
    with pytest.raises(BatchError, match=r"rank \(pp=0, tp=0\): batch 3, seq 5: block_table has 1 blocks"):
        workers("single").execute_model(batch)


def test_token_outside_vocab_is_a_batch_error(workers):
    batch = ModelBatch(4, [SequenceChunk(6, [1, TINY["vocab_size"]], 0, [0])])
    with pytest.raises(BatchError, match="seq 6: token id outside"):
        workers("single").execute_model(batch)


def test_unknown_dtype_is_rejected(checkpoints):
    with pytest.raises(ModelConfigError, match=r"rank \(pp=0, tp=0\): unknown dtype 'float8'"):
        LlamaWorker(single_rank(), model=checkpoints["single"], dtype="float8")


def test_auto_dtype_is_the_checkpoint_dtype(tmp_path, checkpoints, monkeypatch):
    raw = json.loads(open(os.path.join(checkpoints["single"], "config.json")).read())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "dtype": "bfloat16"}))
    monkeypatch.setattr(models.config, "cpu_has_native_bf16", lambda: True)
    assert LlamaWorker(single_rank(), model=str(tmp_path)).dtype == torch.bfloat16
    # Emulated bf16 is several times slower than float32: "auto" does not pick it.
    monkeypatch.setattr(models.config, "cpu_has_native_bf16", lambda: False)
    assert LlamaWorker(single_rank(), model=str(tmp_path)).dtype == torch.float32
    assert LlamaWorker(single_rank(), model=str(tmp_path), dtype="bfloat16").dtype == torch.bfloat16
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if k != "dtype"}))
    assert LlamaWorker(single_rank(), model=str(tmp_path)).dtype == torch.float32


def test_native_bf16_is_read_from_the_cpu_flags():
    assert models.config.cpu_has_native_bf16("flags\t: fpu avx2 avx512f avx512_bf16 amx_tile\n")
    assert models.config.cpu_has_native_bf16("flags\t: fpu avx2 amx_bf16 amx_tile\n")
    assert models.config.cpu_has_native_bf16("Features\t: fp asimd sve bf16 i8mm\n")  # Arm
    assert not models.config.cpu_has_native_bf16("flags\t: fpu avx2 avx512f avx512_vnni\n")
    assert models.config.cpu_has_native_bf16("processor : 0\n")  # no flags to judge by: keep bf16


@pytest.mark.parametrize(
    "num_threads, gemm_kernel",
    [(None, True), (1, True), (1, False), (2, True), (2, False)],
    ids=["default-threads", "one-thread-bf16-gemm", "one-thread-onednn", "two-threads-bf16-gemm", "two-threads-onednn"],
)
def test_bfloat16_logits_stay_close_to_float32(checkpoints, num_threads, gemm_kernel):
    threads_before = torch.get_num_threads()
    try:
        worker = LlamaWorker(
            single_rank(), model=checkpoints["single"], dtype="bfloat16", kv_cache_bytes=KV_BYTES, block_size=BLOCK,
            num_threads=num_threads, bf16_gemm_kernel=gemm_kernel,
        )
        info = worker.load_model()
        # Our GEMM kernel wherever this CPU can run it, on one thread or split over several.
        assert info["bf16_gemm_kernel"] == (gemm_kernel and bf16_gemm.prepare(worker.num_threads))
        # Heads of 16 values are not whole panels: the prompt attention kernel declines them
        # (tests/test_models_prompt_attention.py runs it in a model).
        assert not info["prompt_attention_kernel"]
        tables = block_tables([len(p) for p in PROMPTS], BLOCK)
        logits = worker.compute_logits(prefill_batch(PROMPTS, tables))
        expected = reference_last_logits(checkpoints["single"], PROMPTS)
        assert logits.dtype == torch.float32
        assert (logits - expected).abs().max() < 0.05 * expected.abs().max()
        worker.shutdown()
    finally:
        torch.set_num_threads(threads_before)
        bf16_gemm.set_enabled(True)
        prompt_attention.set_enabled(True)


def test_step_trace_records_each_step_in_order_and_clears(workers):
    worker = workers("single")
    worker.get_step_trace(clear=True)
    tables = block_tables([4, 4], BLOCK)
    for batch_id, (seq, table) in enumerate(zip((20, 21), tables), start=40):
        worker.execute_model(ModelBatch(batch_id, [SequenceChunk(seq, [1, 2, 3], 0, table)]))
    trace = worker.get_step_trace(clear=True)
    assert [entry[0] for entry in trace] == [40, 41]
    for _, start, ready, end in trace:
        assert start <= ready <= end
    assert trace[0][3] <= trace[1][1]
    assert worker.get_step_trace() == []


def test_the_last_stage_lends_its_first_attention_half_back_on_decode_steps():
    # The default model at PP2 splits (5, 3); a decode step leaves the last stage, with its
    # LM head, the busier by about 0.8 layer: layer 5's attention half runs on stage 0.
    layouts = [Layout(default_model_args(), pp=s, pp_size=2, move_boundary_mlp=True, move_boundary_attention=True,
                      move_boundary_back=True) for s in (0, 1)]
    first, last = layouts
    assert first.moves_back and first.borrowed_next == 5 and not first.lends_back
    assert last.lends_back and last.borrowed_next is None
    assert first.cache_layers == [0, 1, 2, 3, 4, 5] and last.cache_layers == [5, 6, 7, 4]
    assert first.most_cache_layers == last.most_cache_layers == 6
    for lay in layouts:
        assert boundary_move(lay, 32, 32, 32) == BoundaryMove.BACK
        assert boundary_move(lay, 1, 1, 1) == BoundaryMove.BACK
        assert boundary_move(lay, 32, 32, 32, allow_back=False) == BoundaryMove.NONE
        assert boundary_move(lay, 512, 20, 24) == BoundaryMove.LAYER  # prompt steps still move forward
    # Where the stage before the last is the busier on decode steps, no copy is kept.
    even = [Layout(default_model_args(), pp=s, pp_size=2, layer_split=(6, 2), move_boundary_back=True) for s in (0, 1)]
    assert not even[0].moves_back and even[0].borrowed_next is None and even[0].cache_layers == list(range(6))
    assert boundary_move(even[0], 32, 32, 32) == BoundaryMove.NONE
    # Off by default in a Layout; with more stages only the last boundary moves.
    assert Layout(default_model_args(), pp=0, pp_size=2).borrowed_next is None
    four = [Layout(default_model_args(), pp=s, pp_size=4, layer_split=(2, 2, 3, 1), move_boundary_back=True)
            for s in range(4)]
    assert [lay.borrowed_next for lay in four] == [None, None, 7, None]
    assert [lay.lends_back for lay in four] == [False, False, False, True]


def test_attention_lent_back_gives_the_same_logits_and_keeps_both_copies_whole(checkpoints):
    """Two in-process stages split (1, 3), the first holding the second's first attention half.

    Steps alternate between running that half on stage 0 (BACK: its keys and values go
    forward) and on stage 1 (their keys and values come back, written into stage 0's copy
    with `LayerKV.write_back`): every step's logits are transformers', and both copies of
    the layer's cache end up equal.
    """
    path = checkpoints["single"]
    args = load_config(path)
    layouts = [Layout(args, pp=s, pp_size=2, layer_split=(1, 3), move_boundary_mlp=True, move_boundary_back=True)
               for s in (0, 1)]
    assert layouts[0].borrowed_next == 1 and layouts[1].lends_back
    stages = [load_stage(lay, path, torch.float32)[0] for lay in layouts]
    assert stages[0].layers["1"].mlp is None and stages[0].layers["1"].self_attn is not None
    steps = 4
    tables = block_tables([len(p) + steps for p in PROMPTS], BLOCK)
    # The first decode step puts each sequence's rows into the mirror (a refill from the
    # paged blocks) whichever stage runs the layer; later steps only add a position.
    for moves in ([BoundaryMove.NONE, BoundaryMove.BACK, BoundaryMove.NONE, BoundaryMove.BACK],
                  [BoundaryMove.NONE, BoundaryMove.NONE, BoundaryMove.BACK, BoundaryMove.BACK],
                  [BoundaryMove.BACK, BoundaryMove.BACK, BoundaryMove.NONE, BoundaryMove.NONE]):
        caches = [
            PagedKVCache(lay.cache_layers, 64, BLOCK, lay.num_local_kv_heads, args.head_dim, torch.float32, "cpu",
                         mirror_bytes=2**20)
            for lay in layouts
        ]
        seqs = [list(p) for p in PROMPTS]
        batch = prefill_batch(PROMPTS, tables)
        for n, move in enumerate(moves):
            step = prepare_step(batch, block_size=BLOCK, num_blocks=64, vocab_size=args.vocab_size)
            next_kv = torch.empty(step.num_tokens, 2, layouts[0].num_local_kv_heads, args.head_dim)
            with torch.inference_mode():
                h = stages[0](step.token_ids, step, caches[0], move=move, next_kv=next_kv)
                h = stages[1](h, step, caches[1], move=move, next_kv=next_kv)
                logits = stages[1].compute_logits(h[step.sample_rows])
                if move != BoundaryMove.BACK:  # what the worker sends back and stage 0 takes later
                    dec = step.decode
                    caches[0].layer(1).write_back(
                        next_kv[:, 0], next_kv[:, 1], step.slot_mapping, dec.rows if dec else None,
                        dec.seq_ids if dec else (), dec.positions if dec else (),
                    )
            torch.testing.assert_close(logits, reference_last_logits(path, seqs), atol=1e-4, rtol=0)
            tokens = logits.argmax(-1).tolist()
            batch = ModelBatch(n + 1, [SequenceChunk(i, [t], len(seqs[i]), tables[i]) for i, t in enumerate(tokens)])
            for s, t in zip(seqs, tokens):
                s.append(t)
        assert torch.equal(caches[0].storage[-1], caches[1].storage[0])  # layer 1: stage 0's copy, stage 1's own
        mirrors = [c.mirror for c in caches]
        for e0, e1 in zip(mirrors[0].entries, mirrors[1].entries):
            assert torch.equal(e0.storage[-1], e1.storage[0])


def test_a_step_too_large_for_the_ring_back_ends_the_back_moves(tmp_path):
    """Both stages decide alike from the step: a step that would send back more keys than the
    ring holds is not sent, and from then on no step moves attention back (the copy would
    miss those keys)."""
    import models.worker as worker_module

    path = build_checkpoint(tmp_path / "heavy", vocab_size=1024)
    for pp in (0, 1):
        ctx = ActorContext(pp=pp, tp=0, tp_size=1, pp_size=2, master_addr="127.0.0.1", master_port=0)
        worker = LlamaWorker(ctx, model=path, layer_split=(2, 2), block_size=BLOCK)
        assert worker.layout.moves_back and worker.set_move_back(True)
        limit = worker_module.BACK_RING_TOKENS
        small, large = (prepare_step(prefill_batch([list(range(n))], [list(range(-(-n // BLOCK)))]), block_size=BLOCK,
                                     num_blocks=10**4, vocab_size=10**4) for n in (limit, limit + 1))
        assert worker._writeback_planned(small, BoundaryMove.NONE)
        assert not worker._writeback_planned(small, BoundaryMove.BACK)  # its keys went forward
        assert not worker._writeback_planned(large, BoundaryMove.NONE)
        assert not worker._writeback_planned(small, BoundaryMove.NONE) and not worker.set_move_back(True)
        assert worker.get_stats()["writeback_steps"] == 1
    # Without the option, or on a layout where the cost model would not use it, nothing is kept.
    ctx = ActorContext(pp=0, tp=0, tp_size=1, pp_size=2, master_addr="127.0.0.1", master_port=0)
    assert not LlamaWorker(ctx, model=path, layer_split=(2, 2), move_boundary_back=False).layout.moves_back
    assert not LlamaWorker(ctx, model=path, layer_split=(3, 1)).layout.moves_back
