"""Regenerate the tiny story corpus and tokenizer shipped in `eqx_tx/data/`.

The corpus is procedurally generated short stories (deterministic, seeded), so the
default `tools/train.py` run needs no download; the tokenizer is a byte-level BPE
trained on it with `tokenizers`.

    python tools/make_tiny_data.py
"""

import dataclasses
import json
import os
import random

import tyro
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

NAMES = ["Lily", "Tom", "Mia", "Ben", "Sara", "Max", "Anna", "Leo", "Zoe", "Sam", "Ella", "Jack"]
ANIMALS = ["cat", "dog", "bird", "fox", "bunny", "bear", "frog", "duck", "mouse", "owl"]
ADJS = ["little", "happy", "brave", "shy", "curious", "kind", "tiny", "clever", "sleepy", "silly"]
PLACES = ["small house", "big forest", "quiet village", "sunny farm", "green park", "old castle"]
LIKES = ["play in the sun", "read books", "sing songs", "run fast", "build towers", "paint pictures",
         "chase butterflies", "bake cakes"]
OBJECTS = ["red ball", "shiny key", "blue box", "old map", "yellow kite", "soft blanket", "magic stone",
           "golden cup"]
LANDMARKS = ["big tree", "river", "garden", "hill", "pond", "bridge", "school", "barn"]
FRIENDS = ["friend", "mom", "dad", "sister", "brother", "grandma", "teacher", "neighbor"]
FEELINGS = ["happy", "surprised", "excited", "proud", "sad", "scared", "tired", "glad"]
ENDINGS = [
    "From that day on, {name} and the {friend} were the best of friends.",
    "{Name} learned that sharing makes everyone happy.",
    "They laughed and played until the sun went down.",
    "{Name} went home and had a long, happy sleep.",
    "It was the best day ever.",
]


def story(rng: random.Random) -> str:
    name, friend = rng.choice(NAMES), rng.choice(FRIENDS)
    pron = rng.choice(["he", "she"])
    poss = "his" if pron == "he" else "her"
    obj, landmark = rng.choice(OBJECTS), rng.choice(LANDMARKS)
    parts = [
        f"Once upon a time, there was a {rng.choice(ADJS)} {rng.choice(ANIMALS)} named {name}.",
        f"{name} lived in a {rng.choice(PLACES)}.",
        f"Every day, {pron} liked to {rng.choice(LIKES)}.",
        f"One day, {name} found a {obj} near the {landmark}.",
        f"{name} felt {rng.choice(FEELINGS)}. {pron.capitalize()} showed the {obj} to {poss} {friend}.",
        f'"What is this?" asked the {friend}. "I do not know," said {name}. "Let us find out!"',
    ]
    if rng.random() < 0.5:
        parts.append(f"They walked to the {rng.choice(LANDMARKS)} and looked for clues.")
    if rng.random() < 0.5:
        parts.append(f"The {obj} began to glow, and they both felt {rng.choice(FEELINGS)}.")
    parts.append(rng.choice(ENDINGS).format(name=name, Name=name, friend=friend))
    return " ".join(parts)


@dataclasses.dataclass
class Args:
    out_dir: str = os.path.join(os.path.dirname(__file__), "..", "eqx_tx", "data")
    """Where tiny_stories.jsonl and tiny_tokenizer.json are written (the package's data folder)."""
    stories: int = 1000
    """How many stories to generate."""
    vocab_size: int = 512
    """The byte-level BPE tokenizer's vocabulary size."""
    seed: int = 0
    """The stories' random seed."""


def main(args: Args) -> None:
    rng = random.Random(args.seed)
    texts = [story(rng) for _ in range(args.stories)]
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "tiny_stories.jsonl"), "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(os.path.join(args.out_dir, "tiny_tokenizer.json"))
    print(f"{len(texts)} stories, vocab {tok.get_vocab_size()} -> {args.out_dir}")


if __name__ == "__main__":
    main(tyro.cli(Args))
