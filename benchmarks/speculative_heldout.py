"""Copy-heavy prompts for checking a drafting or sizing change on text it was not tuned on.

``speculative.py``'s COPY_PROMPTS have been read step by step while the ngram policy was built, so a change
that gains there may only fit them. These 20 are of the same kinds (repeat, quote, summarise, edit a given
text; code; lists; patterns) over other texts; ``speculative_replay.py`` replays every mode on both sets.
Written 2026-12-04, before any policy variant was measured on them.
"""

from __future__ import annotations

BAKERY = ("A small bakery on the corner opens at six every morning. The baker kneads the dough by hand, "
          "shapes the loaves, and slides them into a wood-fired oven. By seven the street smells of bread, "
          "and a line forms outside the door.")
COUNT_WORDS = ("def count_words(text):\n    counts = {}\n    for word in text.split():\n"
               "        word = word.lower()\n        counts[word] = counts.get(word, 0) + 1\n"
               "    return counts\n")
CITIES = "Paris, Berlin, Madrid, Rome, Vienna, Prague, Lisbon, Dublin, Warsaw, Athens, Oslo, Helsinki"

HELDOUT_COPY_PROMPTS = [
    f"Repeat this paragraph exactly:\n{BAKERY}\nParagraph:",
    f"Copy the text below without changes.\n{BAKERY}\nCopy:",
    f"Quote the first sentence of this text.\n{BAKERY}\nQuote:",
    f"Summarise in one sentence using the text's own words:\n{BAKERY}\nSummary:",
    f"Rewrite this text in the past tense.\n{BAKERY}\nRewritten:",
    f"Rewrite this text replacing 'baker' with 'cook'.\n{BAKERY}\nRewritten:",
    f"Correct the spelling mistakes:\n{BAKERY.replace('the', 'hte', 2)}\nCorrected:",
    f"Here is a function:\n{COUNT_WORDS}\nRename it to word_counts and print the whole function:\n",
    f"Print this code again exactly:\n{COUNT_WORDS}\n",
    f"Add type hints to this function and print it in full:\n{COUNT_WORDS}\n",
    f"Change the variable counts to freq in this code:\n{COUNT_WORDS}\n",
    f"Repeat this list of cities: {CITIES}.\nCities:",
    f"Sort these cities alphabetically: {CITIES}.\nSorted:",
    f"Write these cities in upper case: {CITIES}.\nUpper case:",
    f"Put each city on its own line: {CITIES}.\nOne per line:",
    "Count from ten to forty: 10, 11, 12, 13, 14,",
    "Repeat 'all work and no play' five times: all work and no play, all work and no play,",
    "Continue: Monday Tuesday Wednesday Monday Tuesday Wednesday Monday",
    f"Translate into plain English, keeping every detail:\n{BAKERY}\nPlain:",
    "Echo exactly: The quick brown fox jumps over the lazy dog. Echo: The quick brown fox",
]
