"""Where the data that ships with the package lies: a neutral home, so that exporting imports no training module."""

from pathlib import Path

SENTIMENT = Path(__file__).parent / "sentiment"  # train.csv and dev.csv, written by make_sentiment.py
