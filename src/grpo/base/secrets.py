"""Secrets kept out of everything grpo writes or shows: the model card, report.html, run_info.json, checkpoints,
trackers' configs and `repr(GRPOConfig)`.

What counts as a secret, at any depth of dicts, lists and tuples:
- the value under a key that names one (case-insensitive, `-` read as `_`): `token`, `key`, `secret`, `password`,
  `authorization`, `cookie`, `credentials`, `api_key`, and any key ending in `_token`, `_key`, `_secret` or
  `_password` (`hub_token`, `vllm_server_api_key`, `model_init_kwargs={"token": ...}`, `{"X-Api-Key": ...}`);
  None, booleans (`use_auth_token=True` names no token), numbers (a count or a reward named so) and empty
  strings are kept;
- anywhere inside any string: a Hugging Face token (`hf_` and 30 or more letters and digits), a bearer credential
  (`Bearer <credential>`), and every secret found under such a key elsewhere in the same object (a key that also
  sits in a URL), when it is at least 8 characters long (a shorter one would blank out ordinary words).

Redaction is for what is written or shown: the config keeps the real values, which load the model and reach the Hub.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

PLACEHOLDER = "<redacted>"
_NAMES = {"token", "key", "secret", "password", "passwd", "authorization", "cookie", "credential", "credentials"}
_NAMES |= {"api_key", "apikey", "auth_token", "access_token"}
_SUFFIXES = ("_token", "_key", "_apikey", "_secret", "_password")
_HF_TOKEN = re.compile(r"(?<![A-Za-z0-9])hf_[A-Za-z0-9]{30,}")
_BEARER = re.compile(r"(?i)\b(bearer)\s+[A-Za-z0-9._~+/=-]+")
_MIN_KNOWN = 8


def is_secret_key(name: Any) -> bool:
    """Whether the value under the key `name` is a secret."""
    if not isinstance(name, str):
        return False
    name = name.strip().lower().replace("-", "_").replace(" ", "_")
    return name in _NAMES or name.endswith(_SUFFIXES)


def secrets_in(obj: Any) -> set[str]:
    """The strings found under secret keys, at any depth of `obj`."""
    found: set[str] = set()
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            if is_secret_key(k) and isinstance(v, str) and v:
                found.add(v)
            else:
                found |= secrets_in(v)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            found |= secrets_in(v)
    return found


def redact_text(text: str, known: Iterable[str] = ()) -> str:
    """`text` with Hugging Face tokens, bearer credentials and the `known` secrets replaced by PLACEHOLDER."""
    for secret in sorted((s for s in known if len(s) >= _MIN_KNOWN), key=len, reverse=True):
        text = text.replace(secret, PLACEHOLDER)
    if "hf_" in text:  # the plain searches first: a report's completions are megabytes of text without either
        text = _HF_TOKEN.sub(PLACEHOLDER, text)
    if "bearer" in text.lower():
        text = _BEARER.sub(lambda m: f"{m.group(1)} {PLACEHOLDER}", text)
    return text


def redact(obj: Any, known: Iterable[str] = ()) -> Any:
    """A copy of `obj` (dicts, lists, tuples and sets copied at every depth, other objects kept) with every secret
    replaced by PLACEHOLDER; `known` adds secrets to remove from its strings."""
    return _redact(obj, {*known, *secrets_in(obj)})


def _redact(obj: Any, known: set[str]) -> Any:
    if isinstance(obj, str):
        return redact_text(obj, known)
    if isinstance(obj, Mapping):
        return {k: PLACEHOLDER if _hidden(k, v) else _redact(v, known) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_redact(v, known) for v in obj]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(_redact(v, known) for v in obj))
    if isinstance(obj, (tuple, set, frozenset)):
        return type(obj)(_redact(v, known) for v in obj)
    return obj


def _hidden(key: Any, value: Any) -> bool:
    return is_secret_key(key) and value is not None and not isinstance(value, (bool, int, float)) and value != ""
