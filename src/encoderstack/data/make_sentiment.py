"""Write the small sentiment dataset that ships with EncoderStack (train.csv, dev.csv), deterministically.

Short product and film reviews, labelled positive or negative, from hand-written phrase lists: a task that a
pretrained encoder learns in a minute on a CPU, so the demo and the tests can show fine-tuning working.
Re-create with `python src/encoderstack/data/make_sentiment.py` (the committed CSVs are its output).
"""

import csv
import random
from pathlib import Path

SUBJECTS = [
    "the film",
    "this movie",
    "the soundtrack",
    "the acting",
    "the plot",
    "this phone",
    "the battery",
    "the screen",
    "this laptop",
    "the keyboard",
    "the hotel room",
    "the service",
    "the food",
    "this book",
    "the ending",
    "the camera",
    "the headphones",
    "the delivery",
    "this coffee maker",
    "the staff",
    "the app",
    "the update",
    "the sequel",
    "the game",
    "the story",
]
POSITIVE = [
    "was wonderful",
    "is excellent",
    "was a real delight",
    "works perfectly",
    "exceeded my expectations",
    "is absolutely brilliant",
    "was fantastic",
    "made me smile",
    "is worth every penny",
    "was superb",
    "is a pleasure to use",
    "felt charming and warm",
    "was beautifully done",
    "is reliable and fast",
    "was outstanding",
    "left me impressed",
    "is simply great",
    "was lovely",
    "is a joy",
    "was top notch",
]
NEGATIVE = [
    "was terrible",
    "is awful",
    "was a total letdown",
    "stopped working after a day",
    "fell short of my hopes",
    "is painfully boring",
    "was dreadful",
    "made me angry",
    "is a waste of money",
    "was poorly made",
    "is a pain to use",
    "felt cold and lifeless",
    "was badly done",
    "is slow and unreliable",
    "was disappointing",
    "left me frustrated",
    "is simply bad",
    "was horrible",
    "is a mess",
    "was useless",
]
OPENERS = ["", "Honestly, ", "I think ", "To be fair, ", "Overall, ", "Sadly or not, ", "In short, "]
CLOSERS = [".", "!", ", to be honest.", ", all things considered.", ". That is my review.", "."]


def sentence(rng: random.Random, phrases: list[str]) -> str:
    text = f"{rng.choice(OPENERS)}{rng.choice(SUBJECTS)} {rng.choice(phrases)}{rng.choice(CLOSERS)}"
    return text[0].upper() + text[1:]


def rows(rng: random.Random, count: int, seen: set) -> list[tuple[str, str]]:
    out = []
    while len(out) < count:
        label = rng.choice(["positive", "negative"])
        text = sentence(rng, POSITIVE if label == "positive" else NEGATIVE)
        if text not in seen:
            seen.add(text)
            out.append((text, label))
    return out


def main(folder: Path = Path(__file__).parent / "sentiment") -> None:
    rng, seen = random.Random(2026), set()
    folder.mkdir(exist_ok=True)
    for name, count in (("train.csv", 320), ("dev.csv", 120)):
        with open(folder / name, "w", newline="") as file:
            writer = csv.writer(file)
            writer.writerow(["text", "label"])
            writer.writerows(rows(rng, count, seen))


if __name__ == "__main__":
    main()
