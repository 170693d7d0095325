"""The tokenizer of a served model: text <-> token ids, special ids, and its chat template.

Invariant: `encode` gives the ids the original HF tokenizer gives for the same text (special
tokens written in the text, like `<|im_start|>`, are matched whole), and `apply_chat_template`
renders the prompt transformers would render. `eos_token_ids` holds every id that ends a turn:
the declared EOS plus end-of-turn markers the template itself emits (`<|im_end|>`, `<|eot_id|>`...).

Built from a HF folder (tokenizer.json + tokenizer_config.json; Kimi K2's tiktoken.model through
hearth/engine/text/tiktoken_folder.py), from GGUF metadata, or from a
`Checkpoint`'s `tokenizer_source`. Wraps a Rust `tokenizers.Tokenizer`; no transformers import.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer as HFTokenizer

from hearth.engine.text.chat_template import (
    CHATML_TEMPLATE,
    compile_chat_template,
    render_chat_template,
    template_mentions_tools,
)
from hearth.engine.text.gguf_tokenizer import build_gguf_tokenizer
from hearth.engine.text.tiktoken_folder import is_tiktoken_folder, tiktoken_folder_metadata

if TYPE_CHECKING:
    from hearth.models.checkpoint import Checkpoint, TokenizerSource

# Special tokens that end an assistant turn in the chat formats we know; one of these that the
# template writes is treated as EOS even where the config declares a different EOS token.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


class Tokenizer:
    def __init__(
        self,
        backend: HFTokenizer,
        chat_template: str | None = None,
        bos_token_id: int | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template  # None: the model has none; CHATML_TEMPLATE is used
        template_source = chat_template or CHATML_TEMPLATE
        self._template = compile_chat_template(template_source)
        self.supports_tools_in_template = template_mentions_tools(template_source)
        added = backend.get_added_tokens_decoder()
        self.all_special_ids: tuple[int, ...] = tuple(sorted(i for i, t in added.items() if t.special))
        ids = list(eos_token_ids)
        for token in END_OF_TURN_TOKENS:
            token_id = backend.token_to_id(token)
            if token_id is not None and token_id in self.all_special_ids and token in template_source:
                ids.append(token_id)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))
        self.eos_token_id: int | None = self.eos_token_ids[0] if self.eos_token_ids else None
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

    # -- constructors --------------------------------------------------------------------------

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint) -> Tokenizer:
        return cls.from_source(checkpoint.tokenizer_source)

    @classmethod
    def from_source(cls, source: TokenizerSource) -> Tokenizer:
        if source.folder is not None:
            return cls.from_folder(source.folder)
        if source.gguf_metadata is not None:
            return cls.from_gguf(source.gguf_metadata)
        raise ValueError("empty TokenizerSource")

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        """A HF folder: tokenizer.json (or Kimi K2's tiktoken.model), plus
        tokenizer_config.json / chat_template.jinja / generation_config.json when present."""
        folder = Path(path)
        config = _read_json(folder / "tokenizer_config.json")
        if is_tiktoken_folder(folder):  # Kimi K2: tiktoken ranks, no tokenizer.json
            backend = build_gguf_tokenizer(tiktoken_folder_metadata(folder, config))
        elif not (folder / "tokenizer.json").exists():
            raise FileNotFoundError(f"{folder} has no tokenizer.json")
        else:
            backend = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        template = _folder_chat_template(folder, config)
        bos_id = _token_id(backend, config.get("bos_token"))
        eos_ids = [_token_id(backend, config.get("eos_token"))]
        for extra in (_read_json(folder / "generation_config.json"), _read_json(folder / "config.json")):
            eos = extra.get("eos_token_id")
            eos_ids.extend([eos] if isinstance(eos, int) else eos or [])
            if bos_id is None and isinstance(extra.get("bos_token_id"), int):
                bos_id = extra["bos_token_id"]
        return cls(backend, template, bos_id, tuple(i for i in eos_ids if i is not None))

    @classmethod
    def from_gguf(cls, reader_or_metadata: Any) -> Tokenizer:
        """From GGUF metadata: a dict of key -> value, a `hearth.models.gguf_file.GGUFFile`, or a
        `gguf.GGUFReader`."""
        metadata = _gguf_metadata(reader_or_metadata)
        eos_ids = [metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        return cls(
            build_gguf_tokenizer(metadata),
            chat_template=metadata.get("tokenizer.chat_template"),
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(int(i) for i in eos_ids if i is not None),
        )

    # -- text <-> ids --------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. add_special_tokens adds what the model's post-processor adds
        (e.g. Llama 3's BOS); chat templates already write those, hence the default False.
        `encode_batch` gives the same ids but releases the GIL while it works (`encode` holds
        it), so a server thread tokenizing a long text does not freeze its event loop."""
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # -- chat ----------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The prompt text for `messages` (OpenAI-style dicts). Raises ChatTemplateError."""
        return render_chat_template(
            self._template, messages, tools=tools, add_generation_prompt=add_generation_prompt,
            special_tokens=self._special_token_strings(), **kwargs,
        )

    def _special_token_strings(self) -> dict[str, str | None]:
        # Templates such as Llama's write `{{ bos_token }}` themselves.
        bos = self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else None
        eos = self.id_to_token(self.eos_token_id) if self.eos_token_id is not None else None
        return {"bos_token": bos, "eos_token": eos}

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, eos={self.eos_token_ids}, "
            f"chat_template={'yes' if self.chat_template else 'fallback ChatML'})"
        )


def _folder_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja (newer transformers) wins over tokenizer_config.json's chat_template,
    which may also be a list of named templates (we take "default")."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text()
    template = config.get("chat_template") or _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def _token_id(backend: HFTokenizer, token: str | dict | None) -> int | None:
    if isinstance(token, dict):  # serialized AddedToken
        token = token.get("content")
    return backend.token_to_id(token) if token else None


def _gguf_metadata(source: Any) -> dict[str, Any]:
    if isinstance(source, dict):
        return source
    if hasattr(source, "metadata"):  # hearth.models.gguf_file.GGUFFile
        return source.metadata
    if hasattr(source, "fields"):  # gguf.GGUFReader: only the tokenizer keys are needed
        return {k: f.contents() for k, f in source.fields.items() if k.startswith("tokenizer.")}
    raise TypeError(f"expected GGUF metadata, a GGUFFile or a gguf.GGUFReader, got {type(source).__name__}")


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}
