"""A client's speculation switch: what a request asks of speculation, from its header
`x-specgate-speculation`, its body's top-level `speculation` field, or its traffic class's default
(SPECGATE_CLASS_SPECULATION). Pure.

Every engine speculates for a whole server: SGLang, vLLM and llama-server each take the draft
model at launch, and none takes a per-request switch (SGLang's RFC "Per-request opt-out of
speculative decoding", vLLM's `disable_spec_decode`, llama.cpp's "per-request speculative decoding
toggle in llama-server": each asked, none merged). specgate runs a second engine without the draft,
so the switch is where a request goes, never a field the server reads: the body field is removed
before the request is forwarded, and the header is specgate's own.

    asked = the header's, else the body's       (`on`, `off`, `auto`; the body's also true/false;
                                                 both sent and different: 400)
          = the class's default                 where neither says `on` or `off`
    off: a server that does not speculate (reason client_off)
    on:  a speculative server while one is up and its KV pool has room (reason client_on); else
         the usual decision, whose reason says why (routing/steps/switch.py)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, Literal

from ..errors import ApiError
from ..policy.base import Switch
from .classes import NAME_CHARS

__all__ = [
    "FIELD",
    "HEADER",
    "SOURCES",
    "SWITCHES",
    "Source",
    "Switch",
    "asked",
    "class_defaults",
    "from_body",
    "from_header",
]

# Where the switch a request runs with came from (a metric label).
Source = Literal["header", "body", "class"]
SOURCES: Final[tuple[Source, ...]] = ("header", "body", "class")
SWITCHES: Final[tuple[Switch, ...]] = ("on", "off")
HEADER: Final = b"x-specgate-speculation"
FIELD: Final = "speculation"
_WORDS: Final[dict[str, Switch | None]] = {"on": "on", "off": "off", "auto": None}


def from_header(value: bytes | None) -> tuple[bool, Switch | None]:
    """(whether the header was sent, what it asks: None for auto); ApiError 400 for anything else."""
    if value is None:
        return False, None
    word = value.strip().lower().decode("latin-1")
    if word in _WORDS:
        return True, _WORDS[word]
    shown = value[:50].decode("latin-1")
    raise ApiError(400, f"x-specgate-speculation must be on, off or auto, got {shown!r}.", code="invalid_speculation")


def from_body(value: object) -> Switch | None:
    """What the body's `speculation` field asks (None: auto); ApiError 400 for anything else."""
    if value is True or value is False:
        return "on" if value else "off"
    if isinstance(value, str) and value.strip().lower() in _WORDS:
        return _WORDS[value.strip().lower()]
    shown = repr(value)[:50]
    raise ApiError(
        400,
        f'The body\'s speculation must be "on", "off", "auto", true or false, got {shown}.',
        param=FIELD,
        code="invalid_speculation",
    )


def asked(
    header: tuple[bool, Switch | None],
    body: tuple[bool, Switch | None],
    traffic_class: str | None,
    defaults: Mapping[str, Switch],
) -> tuple[Switch | None, Source | None]:
    """(the switch a request runs with, where it came from): the module's rule."""
    (in_header, by_header), (in_body, by_body) = header, body
    if in_header and in_body and by_header != by_body:
        raise ApiError(
            400,
            "x-specgate-speculation and the body's speculation field disagree; send one, or the same in both.",
            param=FIELD,
            code="conflicting_speculation",
        )
    if by_header is not None:
        return by_header, "header"
    if by_body is not None:
        return by_body, "body"
    if traffic_class is not None and defaults:
        found = defaults.get(traffic_class)
        if found is not None:
            return found, "class"
    return None, None


def class_defaults(raw: str) -> dict[str, Switch]:
    """SPECGATE_CLASS_SPECULATION's `class=on|off|auto,...` as a mapping (auto: no entry);
    ValueError naming what is wrong."""
    found: dict[str, Switch] = {}
    for part in raw.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, word = part.rpartition("=")
        name, word = name.strip(), word.strip().lower()
        if not sep or not name:
            raise ValueError(f"{part!r}: each entry is CLASS=on, CLASS=off or CLASS=auto")
        if word not in _WORDS:
            raise ValueError(f"{part!r}: a class's speculation is on, off or auto")
        if name in found:
            raise ValueError(f"class {name!r} is named twice")
        if len(name) > NAME_CHARS or not name.isprintable() or '"' in name or "\\" in name:
            raise ValueError(
                f"class {name[:NAME_CHARS]!r}: at most {NAME_CHARS} printable characters, no quote or backslash"
            )
        switch = _WORDS[word]
        if switch is not None:
            found[name] = switch
    return found
