"""Writes a tiny tokenizer beside each fixture checkpoint in tests/fixtures/ (needs `tokenizers`).

Each `tests/fixtures/hf_*` directory gains
- `tokenizer.json`: a character-level BPE (Metaspace spaces, as SentencePiece
  Llama tokenizers have) trained on a few sentences, with `<s>` prepended on
  encode; 8 special tokens, the printable ASCII alphabet and merges up to
  the fixtures' vocab_size (128) exactly;
- `tokenizer_config.json`: the special tokens and a chat template
  (`<|system|>`/`<|user|>`/`<|assistant|>` turns closed by `<|end|>`);
- `generation_config.json`: `eos_token_id` [`</s>`, `<|end|>`] (the default stop ids).

Deterministic: the same files on every run. Run from the repository root:

  python scripts/make_tokenizer_fixtures.py
"""

from __future__ import annotations

import glob
import json
import os

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "tests", "fixtures")
VOCAB = 128
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
ALPHABET = ["\u2581"] + [chr(c) for c in range(33, 127)]   # Metaspace's space, printable ASCII
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! This is a tiny tokenizer for the jaxkv test fixtures.",
    "Say this is a test. What is the capital of France? Paris is the capital of France.",
    "Once upon a time there was a cache that held the keys and values of many sequences.",
] * 4
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def make_tokenizer():
  from tokenizers import (  # pylint: disable=g-import-not-at-top
      Tokenizer, decoders, models, pre_tokenizers, processors, trainers)
  tok = Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
  tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
  trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL,
                                initial_alphabet=ALPHABET, limit_alphabet=len(ALPHABET),
                                show_progress=False)
  tok.train_from_iterator(CORPUS, trainer=trainer)
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                     special_tokens=[("<s>", 1)])
  assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
  assert [tok.token_to_id(t) for t in SPECIAL] == list(range(len(SPECIAL)))
  return tok


def main() -> None:
  tok = make_tokenizer()
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
            "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
            "add_bos_token": True, "model_max_length": 128, "chat_template": CHAT_TEMPLATE}
  generation = {"bos_token_id": 1, "eos_token_id": [2, SPECIAL.index("<|end|>")],
                "pad_token_id": 0}
  for directory in sorted(glob.glob(os.path.join(FIXTURES, "hf_*"))):
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
      vocab = json.load(f)["vocab_size"]
    if vocab < VOCAB:
      raise SystemExit(f"{directory}: vocab_size={vocab} < the tokenizer's {VOCAB}")
    tok.save(os.path.join(directory, "tokenizer.json"))
    for name, data in (("tokenizer_config.json", config),
                       ("generation_config.json", generation)):
      with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    print("wrote", directory)


if __name__ == "__main__":
  main()
