"""A checkpoint's tokenizer and chat template without transformers: conversation -> ids + labels.

`ChatTokenizer.from_pretrained(dir)` reads `tokenizer.json` (the `tokenizers` package),
`tokenizer_config.json` (special tokens, the family's image/video token names) and the chat
template (`chat_template.jinja`, `chat_template.json` or the tokenizer config's field), and renders
templates in a sandboxed jinja2 environment set up as transformers sets up its own (trim_blocks,
lstrip_blocks, `raise_exception`, `tojson`, loop controls; `{% generation %}` blocks render
their body).

`encode_conversation` renders the whole conversation, replaces each image/video placeholder by the
family processor's expansion (counts from `processors.py`), tokenizes the expanded text in one
pass, and builds labels: a token counts in the loss only when it starts inside an assistant turn's
own text, from the first character the template adds after the assistant prompt up to and
including the end-of-turn token (`eos_token`); -100 elsewhere. The assistant spans come from
rendering the conversation up to each assistant turn with and without it, so any template that
renders a prefix of a conversation as a prefix of the whole works.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Sequence

import numpy as np

from dhp_jax import models

IGNORE = -100
ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
                "bot": "assistant", "system": "system"}
MARKERS = {"<image>": "image", "<video>": "video"}  # LLaVA's placeholders in conversation text
_MARKER_RE = re.compile("(<image>|<video>)")



class ChatError(ValueError):
    """A conversation that cannot become a training sample. `kind` names the problem."""

    def __init__(self, kind: str, message: str):
        self.kind = kind
        super().__init__(message)


@dataclasses.dataclass
class Encoded:
    """One tokenized conversation: `input_ids`, `labels` (-100 where ignored) and
    `mm_token_type_ids` (0 text, 1 image, 2 video) of equal length."""

    input_ids: np.ndarray
    labels: np.ndarray
    mm_token_type_ids: np.ndarray

    def __len__(self) -> int:
        return len(self.input_ids)


def _jinja_env():
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag): the body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        import datetime
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, namespace=jinja2.utils.Namespace)
    return env


def _token_text(v: Any) -> str | None:
    if isinstance(v, dict):  # an AddedToken as older configs store it
        return v.get("content")
    return v


class ChatTokenizer:
    """Tokenizer + chat template + the family's placeholder token names."""

    def __init__(self, tokenizer_json: str, config: dict, chat_template: str, family: str):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(tokenizer_json)
        self.config, self.family = config, family
        self.rules = rules = models.spec(family).chat     # the family's placeholder tokens and expansion
        self.template = _jinja_env().from_string(chat_template)
        self.special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        names = dict(rules.tokens)     # the token names its processor looks up, with their defaults
        extra = config.get("extra_special_tokens")
        for k in names:
            v = config.get(k) or (extra.get(k) if isinstance(extra, dict) else None)
            if v:
                names[k] = _token_text(v)
        self.names = names
        # the end-of-turn token: eos for chat checkpoints; base checkpoints whose eos is
        # <|endoftext|> still close turns with their template's own end token
        self.end_of_turn = [t for t in (self.special["eos_token"], "<|im_end|>", "<|eot_id|>", "<end_of_turn>")
                            if t and self.tok.token_to_id(t) is not None]
        missing = [t for t in names.values() if self.tok.token_to_id(t) is None]
        if missing:
            raise ValueError(f"{tokenizer_json}: the tokenizer has no token for {', '.join(missing)}")
        self.image_placeholder, self.video_placeholder, self.image_ids, self.video_ids = \
            rules.placeholders(names, self.tok.token_to_id)

    @classmethod
    def from_pretrained(cls, checkpoint: str, family: str) -> "ChatTokenizer":
        cfg_path = os.path.join(checkpoint, "tokenizer_config.json")
        config = json.load(open(cfg_path, encoding="utf-8")) if os.path.exists(cfg_path) else {}
        template = None
        for fn in ("chat_template.jinja", "chat_template.json"):
            p = os.path.join(checkpoint, fn)
            if os.path.exists(p):
                text = open(p, encoding="utf-8").read()
                template = json.loads(text)["chat_template"] if fn.endswith(".json") else text
                break
        template = template or config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if not template:
            raise ValueError(f"{checkpoint}: no chat template (chat_template.jinja or tokenizer_config.json)")
        tj = os.path.join(checkpoint, "tokenizer.json")
        if not os.path.exists(tj):
            raise ValueError(f"{checkpoint}: no tokenizer.json")
        return cls(tj, config, template, family)

    # --- rendering --------------------------------------------------------------------------
    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                    tools=None, documents=None,
                                    **{k: v for k, v in self.special.items() if v is not None})

    def encode_text(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    # --- placeholder expansion, as the families' processors do it ----------------------------
    def image_expansion(self, tokens: int) -> str:
        """`tokens`: the image's placeholder tokens (Qwen pad tokens; InternVL context tokens)."""
        return self.rules.image_expansion(self, tokens)

    def video_expansion(self, plan, image_seq_length: int = 256, merge: int = 2) -> str:
        return self.rules.video_expansion(self, plan, image_seq_length, merge)

    # --- a whole sample ----------------------------------------------------------------------
    def encode_conversation(self, messages: list[dict], image_expansions: Sequence[str],
                            video_expansions: Sequence[str]) -> Encoded:
        """ids and labels of `messages` (normalized by `to_messages`), placeholders expanded."""
        if not any(m["role"] == "assistant" for m in messages):
            raise ChatError("no_assistant", "the conversation has no assistant turn")
        full = self.render(messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[:i + 1])
            if not upto.startswith(before) or not full.startswith(upto):
                raise ChatError("template", "the chat template does not render a conversation's prefix as a "
                                            "prefix of it; cannot find the assistant's tokens")
            end = len(upto)
            for eot in self.end_of_turn:
                k = upto.rfind(eot, len(before))
                if k >= 0:
                    end = k + len(eot)
                    break
            spans.append((len(before), end))
        # expand placeholders in order, moving the spans with the text
        pat = "|".join(re.escape(p) for p in (self.image_placeholder, self.video_placeholder))
        pieces, shift, last, img_i, vid_i = [], [], 0, 0, 0
        for mt in re.finditer(pat, full):
            pieces.append(full[last:mt.start()])
            if mt.group() == self.image_placeholder:
                if img_i >= len(image_expansions):
                    raise ChatError("placeholders", f"the conversation has more image placeholders than its "
                                                    f"{len(image_expansions)} image(s)")
                rep = image_expansions[img_i]
                img_i += 1
            else:
                if vid_i >= len(video_expansions):
                    raise ChatError("placeholders", f"the conversation has more video placeholders than its "
                                                    f"{len(video_expansions)} video(s)")
                rep = video_expansions[vid_i]
                vid_i += 1
            pieces.append(rep)
            shift.append((mt.end(), len(rep) - (mt.end() - mt.start())))
            last = mt.end()
        pieces.append(full[last:])
        if img_i != len(image_expansions) or vid_i != len(video_expansions):
            raise ChatError("placeholders", f"{len(image_expansions)} image(s) and {len(video_expansions)} video(s) "
                                            f"but the rendered conversation has {img_i} and {vid_i} placeholders")
        text = "".join(pieces)

        def moved(pos: int) -> int:
            return pos + sum(d for at, d in shift if at <= pos)

        enc = self.tok.encode(text, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int32)
        starts = np.asarray([o[0] for o in enc.offsets], dtype=np.int64)
        labels = np.full(len(ids), IGNORE, dtype=np.int32)
        for b, e in spans:
            sel = (starts >= moved(b)) & (starts < moved(e))
            labels[sel] = ids[sel]
        mm = np.zeros(len(ids), dtype=np.int32)
        mm[np.isin(ids, self.image_ids)] = 1
        if self.video_ids:
            mm[np.isin(ids, self.video_ids)] = 2
        labels[mm != 0] = IGNORE
        return Encoded(ids, labels, mm)


def to_messages(record: dict, n_images: int, n_videos: int) -> list[dict]:
    """A record's turns as chat-template messages with typed content.

    `conversations` (LLaVA: from/value, human/gpt) or `messages` (role/content; content a string
    or a list of {"type": "text"|"image"|"video", ...}). `<image>`/`<video>` markers in text become
    image/video items where they stand; media without markers go before the first user text.
    """
    if "conversations" in record:
        turns, rk, ck = record["conversations"], "from", "value"
    elif "messages" in record:
        turns, rk, ck = record["messages"], "role", "content"
    else:
        raise ChatError("format", "the record has neither 'conversations' nor 'messages'")
    if not isinstance(turns, list) or not turns:
        raise ChatError("format", "'conversations'/'messages' must be a non-empty list of turns")
    out, seen = [], {"image": 0, "video": 0}
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or rk not in t or ck not in t:
            raise ChatError("format", f"turn {i} must be an object with {rk!r} and {ck!r}")
        role = ROLE_ALIASES.get(str(t[rk]).lower())
        if role is None:
            raise ChatError("format", f"turn {i}: unknown role {t[rk]!r}")
        content = t[ck]
        items: list[dict] = []
        if isinstance(content, str):
            for part in _MARKER_RE.split(content):
                if part in MARKERS:
                    items.append({"type": MARKERS[part]})
                    seen[MARKERS[part]] += 1
                elif part:
                    items.append({"type": "text", "text": part})
        elif isinstance(content, list):
            for it in content:
                kind = it.get("type") if isinstance(it, dict) else None
                if kind in ("image", "video"):
                    items.append({"type": kind})
                    seen[kind] += 1
                elif kind == "text" and isinstance(it.get("text"), str):
                    items.append({"type": "text", "text": it["text"]})
                else:
                    raise ChatError("format", f"turn {i}: content item {it!r} is not text, image or video")
        else:
            raise ChatError("format", f"turn {i}: content must be a string or a list")
        out.append({"role": role, "content": items})
    # media the text does not place: before the first user turn's text (LLaVA's convention)
    missing = [("image", n_images - seen["image"]), ("video", n_videos - seen["video"])]
    for kind, n in missing:
        if n < 0:
            raise ChatError("placeholders", f"the conversation has {seen[kind]} <{kind}> markers for "
                                            f"{seen[kind] + n} {kind}(s)")
    if any(n for _, n in missing) and any(seen.values()):
        raise ChatError("placeholders", f"the conversation places {seen['image']} of {n_images} images and "
                                        f"{seen['video']} of {n_videos} videos")
    if any(n for _, n in missing):
        first = next((m for m in out if m["role"] == "user"), None)
        if first is None:
            raise ChatError("format", "media but no user turn to attach them to")
        first["content"][:0] = [{"type": "video"}] * missing[1][1] + [{"type": "image"}] * missing[0][1]
    return out
