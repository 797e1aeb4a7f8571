"""Loading a checkpoint's tokenizer in the driver, while the ranks start.

`AutoTokenizer.from_pretrained` first imports transformers' auto-model machinery
(about 700 modules, 1 s on these cores) to map a class name to a class. Where
tokenizer_config.json names the generic fast tokenizer (Llama 3 checkpoints, the
built-in model), that class is loaded directly: the same class AutoTokenizer would
pick, with the same files, so the same tokens.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Optional

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# The names transformers 4 and 5 write for a tokenizer that is only a tokenizer.json.
GENERIC_FAST_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})


def has_tokenizer(model_dir: str) -> bool:
    """Whether the checkpoint dir holds any tokenizer file."""
    return any(os.path.exists(os.path.join(model_dir, name)) for name in TOKENIZER_FILES)


def tokenizer_class_name(model_dir: str) -> Optional[str]:
    """`tokenizer_class` from tokenizer_config.json, or None where it is missing or unreadable."""
    try:
        with open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8") as f:
            name = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) else None


def load_tokenizer(model_dir: str) -> Optional[Any]:
    """The checkpoint's Hugging Face tokenizer, or None where the dir has no tokenizer files."""
    if not has_tokenizer(model_dir):
        return None
    if tokenizer_class_name(model_dir) in GENERIC_FAST_CLASSES and os.path.exists(
        os.path.join(model_dir, "tokenizer.json")
    ):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
