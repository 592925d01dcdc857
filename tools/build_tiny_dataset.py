"""Write the built-in fine-tuning dataset: small facts the tiny model can visibly learn.

Deterministic (fixed seed). Run: python tools/build_tiny_dataset.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OBJECTS = ["apple", "river", "lamp", "forest", "cloud", "stone", "garden", "window", "bridge", "candle",
           "mountain", "book", "kettle", "violin", "harbor", "meadow", "tower", "mirror", "lantern", "desert",
           "island", "engine", "pocket", "ladder", "compass", "basket", "feather", "anchor", "chimney", "valley",
           "blanket", "marble"]
COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "silver", "golden"]
PLACES = ["north", "south", "east", "west"]


def main() -> None:
    rng = random.Random(1234)
    rows = []
    for obj in OBJECTS:
        color = rng.choice(COLORS)
        place = rng.choice(PLACES)
        rows.append({"instruction": f"What color is the {obj}?", "output": f"The {obj} is {color}."})
        rows.append({"instruction": f"Where is the {obj}?", "output": f"The {obj} is in the {place}."})
    rng.shuffle(rows)
    out = Path(__file__).resolve().parents[1] / "src" / "coserve" / "data" / "tiny_facts.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} rows to {out}")


if __name__ == "__main__":
    main()
