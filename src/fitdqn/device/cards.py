"""Hardware facts of GPUs you may plan for without having one: ``cards.toml`` beside this file.

A probe reads a card's total memory, compute capability and SM count from the driver. A what-if plan
(``fitdqn plan --gpu NAME``) gets them from this table by the card's name (as ``torch.cuda.get_device_name``
reports it) or an alias (``h100``, ``rtx3050``). The compute capability picks PyTorch's cuBLAS workspace rule
(``fitdqn.memory.overhead``); the SM count caps the scratch of CUDA reductions (``fitdqn.memory.kernel_scratch``).
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from fitdqn.device.sizes import parse_size
from fitdqn.errors import UserError

CARD_FIELDS = ("name", "match", "total_memory", "sm_count", "max_threads_per_sm", "compute_capability", "source")


@dataclass(frozen=True)
class Card:
    name: str  # as torch.cuda.get_device_name() reports it
    match: str  # case-insensitive regular expression searched in a device name
    aliases: tuple[str, ...]
    total_bytes: int
    sm_count: int
    max_threads_per_sm: int
    compute_capability: tuple[int, int]
    source: str  # where the numbers came from, in words

    def matches(self, device_name: str) -> bool:
        return re.search(self.match, device_name, re.IGNORECASE) is not None


def parse_cards(text: str, origin: str) -> tuple[Card, ...]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise UserError(f"card table {origin} is not valid TOML: {error}") from None
    cards = []
    for entry in data.get("card", []):
        missing = [key for key in CARD_FIELDS if key not in entry]
        if missing:
            raise UserError(f"card table {origin}: {entry.get('name', '?')} lacks {', '.join(missing)}")
        major, minor = (int(part) for part in str(entry["compute_capability"]).split("."))
        cards.append(Card(
            name=entry["name"], match=entry["match"], aliases=tuple(a.lower() for a in entry.get("aliases", ())),
            total_bytes=parse_size(entry["total_memory"]), sm_count=int(entry["sm_count"]),
            max_threads_per_sm=int(entry["max_threads_per_sm"]), compute_capability=(major, minor),
            source=str(entry["source"]),
        ))
    return tuple(cards)


@lru_cache(maxsize=1)
def shipped_cards() -> tuple[Card, ...]:
    text = (resources.files("fitdqn.device") / "cards.toml").read_text()
    return parse_cards(text, "fitdqn/device/cards.toml")


def find_card(name: str, cards: tuple[Card, ...] | None = None) -> Card | None:
    """The card an alias names (``h100``), else the first whose pattern matches ``name``, else None."""
    cards = shipped_cards() if cards is None else cards
    lowered = name.strip().lower()
    for card in cards:
        if lowered in card.aliases or lowered == card.name.lower():
            return card
    return next((card for card in cards if card.matches(name)), None)


def known_names(cards: tuple[Card, ...] | None = None) -> str:
    cards = shipped_cards() if cards is None else cards
    return ", ".join(card.aliases[0] if card.aliases else card.name for card in cards)
