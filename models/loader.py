"""Loads a rank's share of a Hugging Face Llama checkpoint into a materialized `LlamaStage`.

The checkpoint directory holds config.json and either model.safetensors or
shards listed in model.safetensors.index.json (without an index, every
*.safetensors file is searched). Each rank opens the files lazily and reads only
the tensors its stage has, and of a sharded tensor only its slice
(`safe_open(...).get_slice(name)[start:stop]`), in chunks of at most
CHUNK_BYTES, so its memory holds about 1 / (tp * pp) of the weights plus one chunk.

Every tensor's shape in the file is checked against the config before reading; a
missing or wrong-shaped tensor raises `CheckpointError` naming the tensor, the
shapes and the rank.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

import torch
from safetensors import safe_open
from torch import nn

from models.config import Layout
from models.llama import LlamaStage
from models.parallel import ShardSpec, TPGroup, shard_stage

__all__ = [
    "CheckpointError",
    "CheckpointFiles",
    "LoadReport",
    "checkpoint_name",
    "load_stage",
    "load_stage_weights",
    "materialize",
]

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CHUNK_BYTES = 16 * 2**20


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: missing files or tensors, wrong shapes (names the rank)."""


class CheckpointFiles:
    """Which safetensors file of a checkpoint directory holds each tensor."""

    def __init__(self, path: Union[str, os.PathLike], where: str = "") -> None:
        self.path = os.fspath(path)
        self.where = where
        index = os.path.join(self.path, INDEX_FILE)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    self.weight_map: dict[str, str] = dict(json.load(f)["weight_map"])
            except (ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{where}: {index} is not a safetensors index: {exc!r}") from None
            return
        files = []
        if os.path.isdir(self.path):
            files = sorted(n for n in os.listdir(self.path) if n.endswith(".safetensors"))
        if not files:
            raise CheckpointError(f"{where}: no {SINGLE_FILE} or {INDEX_FILE} in {self.path}")
        self.weight_map = {}
        for name in files:
            with safe_open(os.path.join(self.path, name), framework="pt") as f:
                self.weight_map.update((key, name) for key in f.keys())

    @property
    def files(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    def __contains__(self, tensor: str) -> bool:
        return tensor in self.weight_map


def checkpoint_name(param: str, tied: bool) -> str:
    """The checkpoint tensor behind a `LlamaStage` parameter name."""
    if param == "lm_head.weight":
        return "model.embed_tokens.weight" if tied else param
    return f"model.{param}"


@dataclass
class LoadReport:
    """What one rank loaded."""

    num_tensors: int
    num_params: int
    nbytes: int
    seconds: float


def load_stage_weights(
    stage: nn.Module,
    checkpoint: Union[str, os.PathLike, CheckpointFiles],
    specs: Mapping[str, ShardSpec],
    tied: bool,
    where: str = "",
) -> LoadReport:
    """Copies each parameter of `stage` (already on its device and dtype) from the checkpoint.

    A parameter named in `specs` gets its slice of the checkpoint tensor and zeros
    in any padding; the others get the whole tensor. Shared parameters load once.
    """
    files = checkpoint if isinstance(checkpoint, CheckpointFiles) else CheckpointFiles(checkpoint, where)
    start = time.perf_counter()
    report = LoadReport(0, 0, 0, 0.0)
    for param_name, param in stage.named_parameters():  # each shared parameter once
        name = checkpoint_name(param_name, tied)
        spec = specs.get(param_name)
        expected = spec.full_shape if spec is not None else tuple(param.shape)
        if name not in files:
            raise CheckpointError(
                f"{where}: tensor {name!r} (expected shape {list(expected)}) is missing from "
                f"the checkpoint {files.path} (files: {', '.join(files.files)})"
            )
        file = files.weight_map[name]
        # One open per tensor: the file's mapped pages leave this process's RSS when
        # it closes, so a rank's peak holds its shards plus one tensor, not the file.
        try:
            handle = safe_open(os.path.join(files.path, file), framework="pt")
        except Exception as exc:
            raise CheckpointError(f"{where}: cannot open {file} in {files.path}: {exc}") from exc
        with handle:
            tensor_slice = handle.get_slice(name)
            found = tuple(tensor_slice.get_shape())
            if found != expected:
                raise CheckpointError(
                    f"{where}: tensor {name!r} in {file} has shape {list(found)}, expected {list(expected)}"
                )
            with torch.no_grad():
                _read_into(param, tensor_slice, spec or ShardSpec(0, 0, found[0], found))
            del tensor_slice
        report.num_tensors += 1
        report.num_params += param.numel()
        report.nbytes += param.numel() * param.element_size()
    report.seconds = time.perf_counter() - start
    logger.info(
        "%s loaded %d tensors (%d params, %.1f MB) in %.2fs",
        where,
        report.num_tensors,
        report.num_params,
        report.nbytes / 1e6,
        report.seconds,
    )
    return report


def _read_into(param: torch.Tensor, tensor_slice: Any, spec: ShardSpec) -> None:
    """Copies checkpoint [start, stop) along spec.dim into the front of param, zeroing the rest.

    Reads go in row chunks of about CHUNK_BYTES, so the temporary copies stay small.
    """
    size = spec.stop - spec.start
    rows = spec.full_shape[0]
    if param.dim() == 1:
        param[:size].copy_(tensor_slice[spec.start : spec.stop])
    else:
        row_bytes = max(1, param.shape[1] * param.element_size())
        step = max(1, CHUNK_BYTES // row_bytes)
        if spec.dim == 0:
            for r in range(0, size, step):
                n = min(step, size - r)
                param[r : r + n].copy_(tensor_slice[spec.start + r : spec.start + r + n])
        else:
            for r in range(0, rows, step):
                n = min(step, rows - r)
                param[r : r + n, :size].copy_(tensor_slice[r : r + n, spec.start : spec.stop])
    if param.shape[spec.dim] > size:
        param.narrow(spec.dim, size, param.shape[spec.dim] - size).zero_()


def _release_free_memory() -> None:
    # glibc keeps the freed read buffers in its heap; hand them back to the OS.
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc
        pass


def materialize(module: nn.Module, dtype: torch.dtype, device: Union[torch.device, str]) -> None:
    """Gives every meta-device parameter uninitialized storage of `dtype` on `device`.

    Built from shapes, not with Module.to_empty: empty_like of a meta tensor
    imports sympy and costs every worker 34 MB.
    """
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None and param.is_meta:
                storage = torch.empty(tuple(param.shape), dtype=dtype, device=device)
                sub._parameters[name] = nn.Parameter(storage, requires_grad=False)


def load_stage(
    layout: Layout,
    checkpoint: Union[str, os.PathLike],
    dtype: torch.dtype,
    device: Union[torch.device, str] = "cpu",
    tp: Optional[TPGroup] = None,
) -> tuple[LlamaStage, LoadReport]:
    """The `LlamaStage` of one rank, sharded for its tp rank and loaded from the checkpoint.

    The full model is never materialized: the stage is built and sharded on the
    meta device, then only this rank's shards are allocated and read.
    """
    args = layout.args
    tp = tp if tp is not None else TPGroup(layout.tp, layout.tp_size, None)
    with torch.device("meta"):
        stage = LlamaStage(
            args,
            layout.layers,
            layout.is_first_stage,
            layout.is_last_stage,
            borrowed_mlp=layout.borrowed_mlp,
            borrowed_attention=layout.borrows_attention,
            borrowed_next=layout.borrowed_next,
        )
        specs = shard_stage(stage, layout, tp) if layout.tp_size > 1 else {}
    materialize(stage, dtype, device)
    if args.tie_word_embeddings and stage.embed_tokens is not None and stage.lm_head is not None:
        stage.lm_head.weight = stage.embed_tokens.weight
    report = load_stage_weights(stage, checkpoint, specs, args.tie_word_embeddings, layout.rank_label)
    _release_free_memory()
    stage.eval()
    return stage, report
