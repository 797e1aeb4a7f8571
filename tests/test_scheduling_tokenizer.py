"""The driver's tokenizer loader: the generic fast class directly, anything else through AutoTokenizer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from transformers import AutoTokenizer

from models.default_model import default_model_dir
from scheduling.tokenizer import load_tokenizer, tokenizer_class_name

TEXTS = ["Hello, world!", "  two spaces, a tab\tand a newline\n", "<s> is special; naïve café 你好 🚀"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The same folder as test_default_model.py's fixture: the build runs once per session.
    return default_model_dir(tmp_path_factory.getbasetemp() / "pipeactors-cache")


def copy_with_class(model_dir: Path, target: Path, tokenizer_class: str) -> Path:
    target.mkdir()
    for name in TOKENIZER_FILES:
        shutil.copy(model_dir / name, target / name)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = tokenizer_class
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


def spy_on_auto_tokenizer(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real = AutoTokenizer.from_pretrained

    def recording(path: str, *args: object, **kwargs: object) -> object:
        calls.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", recording)
    return calls


def test_generic_fast_tokenizer_gives_what_auto_tokenizer_gives(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert tokenizer_class_name(str(model_dir)) == "PreTrainedTokenizerFast"
    expected = AutoTokenizer.from_pretrained(model_dir)
    calls = spy_on_auto_tokenizer(monkeypatch)
    tokenizer = load_tokenizer(str(model_dir))
    assert calls == []  # loaded directly
    assert type(tokenizer) is type(expected)
    assert tokenizer.all_special_tokens == expected.all_special_tokens
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (expected.bos_token_id, expected.eos_token_id)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == expected.encode(text) and ids[0] == expected.bos_token_id
        for skip in (True, False):
            assert tokenizer.decode(ids, skip_special_tokens=skip) == expected.decode(ids, skip_special_tokens=skip)


def test_generic_fast_tokenizer_skips_the_auto_machinery(model_dir: Path) -> None:
    code = (
        "import sys; from scheduling.tokenizer import load_tokenizer; "
        f"assert load_tokenizer({str(model_dir)!r}).encode('hi')[0] == 1; "
        "print(sorted(m for m in sys.modules if m.startswith('transformers.models.auto')))"
    )
    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "tokenizer_class, direct",
    [("PreTrainedTokenizerFast", True), ("TokenizersBackend", True), ("LlamaTokenizerFast", False)],
)
def test_only_the_generic_class_skips_auto_tokenizer(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tokenizer_class: str, direct: bool
) -> None:
    target = copy_with_class(model_dir, tmp_path / "tok", tokenizer_class)
    expected = AutoTokenizer.from_pretrained(target)
    calls = spy_on_auto_tokenizer(monkeypatch)
    tokenizer = load_tokenizer(str(target))
    assert calls == ([] if direct else [str(target)])
    assert [tokenizer.encode(t) for t in TEXTS] == [expected.encode(t) for t in TEXTS]


def test_a_dir_without_tokenizer_files_has_no_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(str(tmp_path)) is None
    assert tokenizer_class_name(str(tmp_path)) is None
