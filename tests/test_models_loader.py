"""The loader: each rank reads only its slices; bad checkpoints fail naming tensor, shapes and rank."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.config import Layout, load_config
from models.loader import CheckpointError, load_stage
from tests.model_checkpoints import ODD, build_checkpoint

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    return {
        "single": build_checkpoint(root / "single"),
        "sharded": build_checkpoint(root / "sharded", max_shard_size="100KB"),
        "odd": build_checkpoint(root / "odd", seed=4, **ODD),
        "tied": build_checkpoint(root / "tied", seed=2, tie_word_embeddings=True),
    }


def full_state(path: str) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(path, name)))
    return state


def rewrite(src: str, dst, edit) -> str:
    """A copy of checkpoint `src` at `dst` whose single file's tensors went through `edit(dict)`."""
    shutil.copytree(src, dst)
    file = os.path.join(dst, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    return os.fspath(dst)


def test_sharded_checkpoint_loads_like_a_single_file(checkpoints):
    assert os.path.exists(os.path.join(checkpoints["sharded"], "model.safetensors.index.json"))
    layout = Layout(load_config(checkpoints["sharded"]))
    stage, report = load_stage(layout, checkpoints["sharded"], torch.float32)
    state = full_state(checkpoints["sharded"])
    for name, param in stage.named_parameters():
        assert torch.equal(param, state[f"model.{name}" if name != "lm_head.weight" else name]), name
    assert report.num_params == sum(t.numel() for t in state.values())


@pytest.mark.parametrize("name", ["single", "odd", "tied"])
@pytest.mark.parametrize("tp, pp", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_rank_holds_exactly_its_slices(checkpoints, name, tp, pp):
    path = checkpoints[name]
    args = load_config(path)
    layout = Layout(args, tp=tp, tp_size=2, pp=pp, pp_size=2)
    stage, report = load_stage(layout, path, torch.float32)
    state = full_state(path)
    hd = args.head_dim
    (q0, q1), (k0, k1), (i0, i1), (v0, v1) = layout.q_heads, layout.kv_heads, layout.intermediate, layout.vocab
    for index in layout.layers:
        layer, prefix = stage.layers[str(index)], f"model.layers.{index}"
        attn, mlp = layer.self_attn, layer.mlp
        assert torch.equal(attn.q_proj.weight, state[f"{prefix}.self_attn.q_proj.weight"][q0 * hd : q1 * hd])
        assert torch.equal(attn.k_proj.weight, state[f"{prefix}.self_attn.k_proj.weight"][k0 * hd : k1 * hd])
        assert torch.equal(attn.v_proj.weight, state[f"{prefix}.self_attn.v_proj.weight"][k0 * hd : k1 * hd])
        assert torch.equal(attn.o_proj.weight, state[f"{prefix}.self_attn.o_proj.weight"][:, q0 * hd : q1 * hd])
        assert torch.equal(mlp.up_proj.weight, state[f"{prefix}.mlp.up_proj.weight"][i0:i1])
        assert torch.equal(mlp.down_proj.weight, state[f"{prefix}.mlp.down_proj.weight"][:, i0:i1])
        assert torch.equal(layer.input_layernorm.weight, state[f"{prefix}.input_layernorm.weight"])
    vocab_tensors = []
    if pp == 0:
        vocab_tensors.append((stage.embed_tokens.weight, state["model.embed_tokens.weight"]))
    else:
        assert stage.embed_tokens is None
        head = state["model.embed_tokens.weight" if args.tie_word_embeddings else "lm_head.weight"]
        vocab_tensors.append((stage.lm_head.weight, head))
    for param, full in vocab_tensors:
        assert param.shape[0] == layout.vocab_shard_size
        assert torch.equal(param[: v1 - v0], full[v0:v1])
        assert not param[v1 - v0 :].any()  # padding rows of the last shard
    # About a quarter of the model per rank (embedding and head are the same size, one per stage).
    total = sum(t.numel() for t in state.values())
    assert report.num_params < 0.4 * total


@pytest.mark.parametrize("tp", [0, 1])
def test_last_stage_holds_the_sharded_mlp_of_the_layer_before_it(checkpoints, tp):
    path = checkpoints["odd"]  # uneven intermediate size: the two tp shards differ
    args = load_config(path)
    layout = Layout(args, tp=tp, tp_size=2, pp=1, pp_size=2, move_boundary_mlp=True)
    stage, report = load_stage(layout, path, torch.float32)
    without, _ = load_stage(Layout(args, tp=tp, tp_size=2, pp=1, pp_size=2), path, torch.float32)
    state = full_state(path)
    index = layout.borrowed_mlp
    assert index == layout.layers.start - 1 and str(index) in stage.layers and str(index) not in without.layers
    layer, prefix = stage.layers[str(index)], f"model.layers.{index}"
    assert layer.self_attn is None and layer.input_layernorm is None  # no attention, no KV cache
    i0, i1 = layout.intermediate
    assert torch.equal(layer.mlp.gate_proj.weight, state[f"{prefix}.mlp.gate_proj.weight"][i0:i1])
    assert torch.equal(layer.mlp.up_proj.weight, state[f"{prefix}.mlp.up_proj.weight"][i0:i1])
    assert torch.equal(layer.mlp.down_proj.weight, state[f"{prefix}.mlp.down_proj.weight"][:, i0:i1])
    assert torch.equal(layer.post_attention_layernorm.weight, state[f"{prefix}.post_attention_layernorm.weight"])
    mlp_params = 3 * args.hidden_size * (i1 - i0) + args.hidden_size
    assert report.num_params == sum(p.numel() for p in without.parameters()) + mlp_params


@pytest.mark.parametrize("tp", [0, 1])
def test_last_stage_can_hold_the_whole_sharded_layer_before_it(checkpoints, tp):
    path = checkpoints["odd"]
    args = load_config(path)
    split = dict(tp=tp, tp_size=2, pp=1, pp_size=2, layer_split=(2, 1), move_boundary_mlp=True)
    layout = Layout(args, **split, move_boundary_attention=True)
    stage, report = load_stage(layout, path, torch.float32)
    mlp_only, mlp_report = load_stage(Layout(args, **split), path, torch.float32)
    state = full_state(path)
    index = layout.borrowed_mlp
    layer, prefix = stage.layers[str(index)], f"model.layers.{index}.self_attn"
    assert stage.borrowed_attention and layer.self_attn is not None
    # This tp rank's heads, as for any of its own layers.
    hd = args.head_dim
    (q0, q1), (k0, k1) = layout.q_heads, layout.kv_heads
    attn = layer.self_attn
    assert (attn.n_heads, attn.n_kv_heads) == (q1 - q0, k1 - k0)
    assert torch.equal(attn.q_proj.weight, state[f"{prefix}.q_proj.weight"][q0 * hd : q1 * hd])
    assert torch.equal(attn.k_proj.weight, state[f"{prefix}.k_proj.weight"][k0 * hd : k1 * hd])
    assert torch.equal(attn.v_proj.weight, state[f"{prefix}.v_proj.weight"][k0 * hd : k1 * hd])
    assert torch.equal(attn.o_proj.weight, state[f"{prefix}.o_proj.weight"][:, q0 * hd : q1 * hd])
    norm = state[f"model.layers.{index}.input_layernorm.weight"]
    assert torch.equal(layer.input_layernorm.weight, norm)
    attention_params = args.hidden_size * hd * (2 * (q1 - q0) + 2 * (k1 - k0)) + args.hidden_size
    assert report.num_params == mlp_report.num_params + attention_params


def test_missing_tensor_names_tensor_shape_and_rank(checkpoints, tmp_path):
    path = rewrite(checkpoints["single"], tmp_path / "ckpt", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    layout = Layout(load_config(path), tp=1, tp_size=2, pp=0, pp_size=2)
    with pytest.raises(CheckpointError) as info:
        load_stage(layout, path, torch.float32)
    message = str(info.value)
    assert "rank (pp=0, tp=1)" in message
    assert "'model.layers.1.mlp.up_proj.weight'" in message and "missing" in message
    assert "[128, 64]" in message


def test_wrong_shape_names_tensor_both_shapes_and_rank(checkpoints, tmp_path):
    def shrink(tensors):
        tensors["model.layers.3.self_attn.k_proj.weight"] = tensors["model.layers.3.self_attn.k_proj.weight"][:16]

    path = rewrite(checkpoints["single"], tmp_path / "ckpt", shrink)
    layout = Layout(load_config(path), tp=0, tp_size=2, pp=1, pp_size=2)
    with pytest.raises(CheckpointError) as info:
        load_stage(layout, path, torch.float32)
    message = str(info.value)
    assert "rank (pp=1, tp=0)" in message
    assert "'model.layers.3.self_attn.k_proj.weight'" in message
    assert "has shape [16, 64], expected [32, 64]" in message


def test_untied_checkpoint_without_lm_head_is_an_error(checkpoints, tmp_path):
    path = rewrite(checkpoints["single"], tmp_path / "ckpt", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match="'lm_head.weight'.*missing"):
        load_stage(Layout(load_config(path)), path, torch.float32)


def test_directory_without_safetensors_is_an_error(checkpoints, tmp_path):
    shutil.copy(os.path.join(checkpoints["single"], "config.json"), tmp_path / "config.json")
    with pytest.raises(CheckpointError, match=r"rank \(pp=0, tp=0\): no model.safetensors"):
        load_stage(Layout(load_config(tmp_path)), tmp_path, torch.float32)


def test_bfloat16_checkpoint_converts_to_the_requested_dtype(checkpoints, tmp_path):
    def to_bf16(tensors):
        tensors.update({k: v.bfloat16() for k, v in tensors.items()})

    path = rewrite(checkpoints["single"], tmp_path / "ckpt", to_bf16)
    stage, _ = load_stage(Layout(load_config(path)), path, torch.float32)
    state = full_state(path)
    assert stage.norm.weight.dtype == torch.float32
    assert torch.equal(stage.norm.weight, state["model.norm.weight"].float())
