"""``slotq bench spec``'s copy-heavy prompts: tasks whose answer copies most of the prompt.

Speculative decoding pays where the output repeats the input: rewriting, extraction, edits of a
list. :func:`copy_prompt` writes such a task for any index, deterministically, from word lists
(no download, no model): prompt ``i`` is the same on every machine and run, and two indices give
two different texts, so every client of every round gets prompts of its own and no prefix cache
(slotq's or llama-server's) can skip their prefill. The text is 200 to 800 tokens long on the
bundled model's tokenizer (tests/cli/test_spec_bench.py checks it); the instruction tells the model
to copy it with one small change, so a greedy answer is mostly a copy.

Three tasks take turns: ``i % 3`` = 0 rewrite prose with one word replaced, 1 extract fields of
order records as JSON, 2 repeat a stock list with one column edited.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable

SEED = "slotq-bench-spec"
MIN_TOKENS, MAX_TOKENS = 200, 800
# The generator counts words, not tokens (it has no tokenizer): these word counts land between
# MIN_TOKENS and MAX_TOKENS with a margin on the bundled model (SmolLM2's BPE, about 1.3 tokens per
# word of this prose, more for the digit-heavy records and lists).
WORD_TARGETS = {"rewrite": (160, 540), "extract": (90, 330), "list": (90, 350)}
TASKS = ("rewrite", "extract", "list")

FIRST_NAMES = ["Maria", "Jonas", "Aiko", "Samuel", "Lena", "Omar", "Priya", "Tomas", "Grace", "Mateo", "Ingrid",
               "Kwame", "Elena", "Hugo", "Nadia", "Felix", "Rosa", "Viktor", "Amara", "Lucas", "Sofia", "Ravi"]
SURNAMES = ["Lopez", "Berg", "Tanaka", "Okafor", "Fischer", "Haddad", "Sharma", "Novak", "Wright", "Silva",
            "Larsen", "Mensah", "Petrova", "Moreau", "Khan", "Weber", "Costa", "Ivanov", "Diallo", "Rossi"]
CITIES = ["Porto", "Leeds", "Osaka", "Lagos", "Bremen", "Beirut", "Pune", "Brno", "Halifax", "Recife", "Bergen",
          "Accra", "Kazan", "Lyon", "Lahore", "Graz", "Braga", "Tartu", "Dakar", "Turin", "Cusco", "Perth"]
STREETS = ["Harbour Street", "Mill Lane", "Station Road", "Church Walk", "Market Square", "Orchard Row",
           "Bridge Street", "Quarry Road", "Canal Side", "Hill Terrace", "Park Avenue", "Foundry Yard"]
COLOURS = ["blue", "green", "grey", "amber", "white", "black", "copper", "olive", "crimson", "ivory"]
PRODUCTS = ["lamp", "kettle", "chair", "rucksack", "teapot", "blanket", "bicycle bell", "desk", "mirror",
            "notebook", "umbrella", "clock", "vase", "toolbox", "stool", "lantern", "radio", "bookshelf"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
CARRIERS = ["rail", "road", "sea freight", "courier", "air mail"]
SUPPLIERS = ["Norden", "Alba Works", "Kessler", "Maple & Co", "Ostrava Steel", "Sunfield", "Tiber", "Helix"]
PLACES = ["village", "harbour", "valley", "market town", "river port", "mountain pass", "island", "old quarter"]
TRADES = ["weavers", "fishers", "potters", "clockmakers", "bakers", "printers", "glassblowers", "carpenters"]
SEASONS = ["spring", "summer", "autumn", "winter"]
OBJECTS = ["bridge", "library", "lighthouse", "square", "school", "mill", "chapel", "railway station", "museum"]
FEELINGS = ["proud", "curious", "patient", "cheerful", "careful", "stubborn", "generous", "quiet"]

# Prose sentences: {name}, {city}, ... are filled from the lists above.
SENTENCES = [
    "In the {season} of {year}, {name} moved to {city} to work with the {trade} of the {place}.",
    "The {trade} of {city} met every morning near the old {obj}, where {name} kept a small workshop.",
    "{name} was known as a {feeling} neighbour who repaired the {obj} without asking for payment.",
    "Visitors to the {place} often asked {name} about the history of the {obj} and the {trade}.",
    "Every {season}, the people of {city} held a fair, and {name} sold {colour} {product}s at a stall.",
    "When the river rose in {year}, the {trade} carried their tools to the {obj} and waited for the water to fall.",
    "{name} wrote letters to a cousin in {city2}, describing the {place}, the {trade} and the weather.",
    "The council of {city} voted to restore the {obj}, and {name} offered to keep the accounts.",
    "Children from the {place} came after school to watch {name} at work and to learn the names of the tools.",
    "By the end of the {season}, the {obj} had a new roof, and the {trade} painted its doors {colour}.",
    "A traveller from {city2} stayed for a week and said the {place} was the most {feeling} place on the coast.",
    "{name} kept a notebook of every order, every delivery and every visitor to the workshop.",
]


def _fill(rng: random.Random, template: str, name: str, city: str) -> str:
    return template.format(
        name=name, city=city, city2=rng.choice([c for c in CITIES if c != city]), trade=rng.choice(TRADES),
        place=rng.choice(PLACES), obj=rng.choice(OBJECTS), season=rng.choice(SEASONS), year=rng.randint(1890, 1990),
        feeling=rng.choice(FEELINGS), colour=rng.choice(COLOURS), product=rng.choice(PRODUCTS))


def _until(words: int, unit: Callable[[], str]) -> list[str]:
    """Units (sentences, records, list lines) until they hold ``words`` words."""
    parts: list[str] = []
    while sum(len(p.split()) for p in parts) < words:
        parts.append(unit())
    return parts


def _rewrite(rng: random.Random, i: int, words: int) -> str:
    name, city = f"{rng.choice(FIRST_NAMES)} {rng.choice(SURNAMES)}", rng.choice(CITIES)
    sentences = _until(words, lambda: _fill(rng, rng.choice(SENTENCES), name, city))
    paragraphs = [" ".join(sentences[k:k + 4]) for k in range(0, len(sentences), 4)]
    new_city = rng.choice([c for c in CITIES if c != city])
    return (f"Rewrite the following text (document {i}) exactly as it is, with one change: write {new_city} "
            f"instead of {city} everywhere. Keep every other word the same.\n\n" + "\n\n".join(paragraphs))


def _record(rng: random.Random, order: int) -> tuple[str, dict[str, str]]:
    """One order as a sentence, and its fields as the answer should copy them."""
    fields = {"order": str(order),
              "date": f"{rng.randint(1, 28)} {rng.choice(MONTHS)} {rng.randint(2019, 2026)}",
              "name": f"{rng.choice(FIRST_NAMES)} {rng.choice(SURNAMES)}",
              "address": f"{rng.randint(1, 120)} {rng.choice(STREETS)}", "city": rng.choice(CITIES),
              "quantity": str(rng.randint(1, 9)), "item": f"{rng.choice(COLOURS)} {rng.choice(PRODUCTS)}",
              "carrier": rng.choice(CARRIERS)}
    return (f"Order {order} was placed on {fields['date']} by {fields['name']} of {fields['address']}, "
            f"{fields['city']}, for {fields['quantity']} of the {fields['item']}; it was sent by {fields['carrier']}."
            ), fields


def _extract(rng: random.Random, i: int, words: int) -> str:
    orders = itertools.count(1000 + 41 * i)
    records: list[tuple[str, dict[str, str]]] = []
    while sum(len(text.split()) for text, _ in records) < words:
        records.append(_record(rng, next(orders)))
    return (f"Extract the fields of every order below (batch {i}) as JSON, one object per line, in the same "
            f"order. The first line is:\n{json.dumps(records[0][1])}\n\n" + "\n".join(text for text, _ in records))


def _list(rng: random.Random, i: int, words: int) -> str:
    lines = _until(words, lambda: (f"{rng.randint(1, 60)} x {rng.choice(COLOURS)} {rng.choice(PRODUCTS)}, shelf "
                                   f"{rng.choice('ABCDEFGH')}{rng.randint(1, 24)}, supplier {rng.choice(SUPPLIERS)}, "
                                   f"checked by {rng.choice(FIRST_NAMES)}"))
    colour = rng.choice(COLOURS)
    numbered = "\n".join(f"{k + 1}. {line}" for k, line in enumerate(lines))
    return (f"Repeat this stock list (count {i}) line by line with one edit: every {colour} item moves to shelf Z1. "
            f"Keep all other text and the numbering exactly the same.\n\n{numbered}")


_WRITERS = {"rewrite": _rewrite, "extract": _extract, "list": _list}


def copy_prompt(i: int) -> str:
    """Copy-heavy task ``i`` (a user message for the chat template): the same for the same ``i``, always."""
    task = TASKS[i % len(TASKS)]
    rng = random.Random(f"{SEED}:{i}")           # a str seed hashes the same in every process
    low, high = WORD_TARGETS[task]
    return _WRITERS[task](rng, i, rng.randint(low, high))
