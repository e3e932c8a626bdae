"""A user's records -> training samples of a checkpoint's family, in two steps.

`plan(record)` reads headers and metadata only (image sizes, video frame counts and rates), renders
and tokenizes the conversation with the placeholders expanded, and returns a `Planned` sample whose
`num_tokens` is final: the planner can pack before any pixel is decoded. `materialize(planned)`
decodes the media and returns the inputs the family's transformers model takes at batch size 1
(`input_ids`, `labels`, `attention_mask`, `mm_token_type_ids`, `pixel_values` with
`image_grid_thw`, `pixel_values_videos` with `video_grid_thw`, `second_per_grid_ts`; InternVL:
`pixel_values` [tiles, 3, S, S] with images and video frames in text order) and checks that the
decoded grids are the planned ones.

Bad data never stops a scan with `on_error="skip"`: each problem is a `DataIssue` naming the kind,
the place (file:line, shard:key, or sample id) and the file as the data wrote it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Iterator, Mapping

import numpy as np

from dhp_jax.data.chat import ChatError, ChatTokenizer, Encoded, to_messages
from dhp_jax.data.media import MediaError, image_size, load_image, load_video_frames, video_info
from dhp_jax.data.processors import VideoPlan, VisionProcessor, family_of
from dhp_jax.data.sample import Sample, Segment
from dhp_jax.data.sources import Record

ISSUE_KINDS = ("unreadable_line", "missing_media", "corrupt_image", "corrupt_video", "no_frames",
               "no_assistant", "too_long", "duplicate_id", "bad_conversation", "converted_image")


class DataError(ValueError):
    """A record that cannot become a sample (`on_error="fail"` raises it)."""

    def __init__(self, kind: str, where: str, message: str):
        self.kind, self.where, self.message = kind, where, message
        super().__init__(f"{where}: {kind}: {message}")

    def line(self) -> str:
        return f"{self.kind}\t{self.where}\t{self.message}"


@dataclasses.dataclass
class Planned:
    """A sample known from metadata: its tokens, labels and the plan of each medium."""

    sample_id: str
    where: str
    record: Record
    encoded: Encoded
    image_grids: list[tuple[int, int, int]]
    video_plans: list[VideoPlan]
    order: list[str]  # "image"/"video" in the order the conversation places them

    @property
    def num_tokens(self) -> int:
        return len(self.encoded)

    def to_sample(self) -> Sample:
        """The planner's view: text / image / video segments in stream order (runs of the
        mm_token_type_ids), text segments with their token ids; no pixels."""
        mm, ids = self.encoded.mm_token_type_ids, self.encoded.input_ids
        cuts = np.flatnonzero(np.diff(mm)) + 1
        segs = []
        for b, e in zip(np.r_[0, cuts], np.r_[cuts, len(mm)]):
            kind = ("text", "image", "video")[int(mm[b])]
            segs.append(Segment(kind, int(e - b), token_ids=ids[b:e] if kind == "text" else None))
        return Sample(tuple(segs), sample_id=self.sample_id, source=self.where)


class FinetuneData:
    """The checkpoint's processors and tokenizer applied to records (see the module docstring)."""

    def __init__(self, checkpoint: str, max_tokens: int | None = None, family: str | None = None,
                 video_sampling: Mapping[str, Any] | str | None = "auto"):
        """`video_sampling`: the video keywords the run passes to the processor call ("auto": the
        checkpoint's own sampling, or its family's rate where its video processor takes every frame;
        `processors.resolve_video_sampling`), the same value the planner's `vision_rules` takes."""
        self.family = family or family_of(checkpoint)
        self.vision = VisionProcessor.from_pretrained(checkpoint, self.family, video_sampling)
        self.chat = ChatTokenizer.from_pretrained(checkpoint, self.family)
        self.max_tokens = max_tokens

    # --- step 1: metadata only ----------------------------------------------------------------
    def plan(self, rec: Record) -> Planned:
        if rec.error:
            raise DataError("unreadable_line", rec.where, rec.error)
        where = f"{rec.where} (id {rec.sample_id})" if "id" in rec.data else rec.where
        images = [m for m in rec.media if m.kind == "image"]
        videos = [m for m in rec.media if m.kind == "video"]
        try:
            msgs = to_messages(rec.data, len(images), len(videos))
        except ChatError as e:
            raise DataError("no_assistant" if e.kind == "no_assistant" else "bad_conversation", where, str(e)) from None
        grids, expansions = [], []
        for m in images:
            w, h = _media(lambda: image_size(m.src, m.name), "image", where)
            try:
                grids.append(self.vision.image_grid(w, h))
            except ValueError as e:
                raise DataError("corrupt_image", where, f"{m.name}: {e}") from None
            expansions.append(self.chat.image_expansion(self.vision.image_tokens(w, h)))
        plans, vexp = [], []
        for m in videos:
            info = _media(lambda: video_info(m.src, m.name), "video", where)
            try:
                plan = self.vision.video_plan(info)
            except (ValueError, MediaError) as e:
                raise DataError("no_frames", where, f"{m.name}: {e}") from None
            plans.append(plan)
            vexp.append(self.chat.video_expansion(plan, self.vision.image_seq_length,
                                                  self.vision.video.get("merge_size", 2)))
        try:
            enc = self.chat.encode_conversation(msgs, expansions, vexp)
        except ChatError as e:
            raise DataError("no_assistant" if e.kind == "no_assistant" else "bad_conversation", where, str(e)) from None
        if not (enc.labels != -100).any():
            raise DataError("no_assistant", where, "no assistant token is left to learn from")
        if self.max_tokens is not None and len(enc) > self.max_tokens:
            raise DataError("too_long", where, f"{len(enc)} tokens, above the limit of {self.max_tokens}")
        order = [c["type"] for m in msgs for c in m["content"] if c["type"] in ("image", "video")]
        return Planned(rec.sample_id, where, rec, enc, grids, plans, order)

    def scan(self, records: Iterable[Record], on_error: str = "skip",
             issues: list[DataError] | None = None) -> Iterator[Planned]:
        """Plans of the good records; bad ones raise (`fail`) or go to `issues` (`skip`).
        A repeated id is a `duplicate_id` issue (its first occurrence is kept)."""
        if on_error not in ("skip", "fail"):
            raise ValueError(f"on_error must be 'skip' or 'fail', got {on_error!r}")
        seen: dict[str, str] = {}
        for rec in records:
            try:
                if not rec.error and "id" in rec.data:
                    sid = rec.sample_id
                    if sid in seen:
                        raise DataError("duplicate_id", rec.where, f"id {sid!r} was already used at {seen[sid]}")
                    seen[sid] = rec.where
                yield self.plan(rec)
            except DataError as e:
                if on_error == "fail":
                    raise
                if issues is not None:
                    issues.append(e)

    # --- step 2: pixels ---------------------------------------------------------------------------
    def materialize(self, p: Planned, notes: list[DataError] | None = None) -> dict[str, np.ndarray]:
        """The model inputs of a planned sample (see the module docstring)."""
        enc = p.encoded
        out: dict[str, np.ndarray] = {"input_ids": enc.input_ids[None], "labels": enc.labels[None],
                                      "attention_mask": np.ones((1, len(enc)), np.int32),
                                      "mm_token_type_ids": enc.mm_token_type_ids[None]}
        pix, grids = [], []
        order = [m for m in p.record.media]
        images = [m for m in order if m.kind == "image"]
        videos = [m for m in order if m.kind == "video"]
        for m, grid in zip(images, p.image_grids):
            rgb, mode = _media(lambda: load_image(m.src, m.name), "image", p.where)
            if mode != "RGB" and notes is not None:
                notes.append(DataError("converted_image", p.where, f"{m.name}: mode {mode} converted to RGB"))
            pv, g = self.vision.process_image(rgb)
            if tuple(g) != tuple(grid):
                raise DataError("corrupt_image", p.where, f"{m.name}: decoded size gives grid {g}, header {grid}")
            pix.append(pv)
            grids.append(g)
        vpix = []
        for m, plan in zip(videos, p.video_plans):
            frames = _media(lambda: load_video_frames(m.src, plan.indices, m.name), "video", p.where)
            vpix.append(self.vision.process_video(frames, plan))
        # the family's processor output keys (Qwen: patch rows and grids; InternVL: one tile stack)
        self.vision.model_inputs(out, pix, grids, vpix, list(p.video_plans), list(p.order))
        return out


def _media(fn, kind: str, where: str):
    try:
        return fn()
    except MediaError as e:
        k = {"missing": "missing_media", "no_frames": "no_frames"}.get(e.kind, f"corrupt_{kind}")
        raise DataError(k, where, str(e)) from None


def write_issues(path: str, issues: Iterable[DataError]) -> int:
    """One line per problem ("kind<TAB>where<TAB>message"); returns how many were written."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for e in issues:
            f.write(e.line() + "\n")
            n += 1
    return n
