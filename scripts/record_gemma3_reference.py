"""Record what transformers makes of the Gemma 3 270M GGUF, for tests/checkpoints/test_gemma3_gguf.py.

Run it with a Python that has transformers (5.x), torch, accelerate and gguf (not specjax's venv):

  python scripts/record_gemma3_reference.py --gguf ~/.cache/specjax/models/gemma3-270m/gemma-3-270m-q4_k_m.gguf

It writes tests/data/gemma3_270m_reference.json (``--out``) with:
  tokenizer   for each of ``TOKENIZER_TEXTS``: the ids with <bos> (``encode``) and their decoding; for each of
              ``decode_cases``: the decoding of an id list with and without the special tokens
  config      the Hugging Face config transformers builds from the file (the fields specjax reads)
  params      a fingerprint of every tensor of the loaded model (transformers' names; Gemma3RMSNorm weights
              are w in ``1 + w``): shape, float64 sum and absolute sum, values at fixed flat indices
  logprobs    for each of ``LOGPROB_TEXTS``: ids (with <bos>), the log-probability of each next token, the
              argmax at each position; for the first prose and the first code text also the greedy 16-token
              continuation (recomputed over the whole sequence each step) and its log-probabilities
The model is loaded in float32 with eager attention.

``--compare-tokenizer FILE`` (a ``tokenizers`` JSON that specjax built, e.g. ``tok.hf.to_str()``) instead
encodes a larger corpus (``CORPUS`` plus this Python's standard library sources) with both tokenizers and
prints how many texts and tokens agree.
"""
from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "gemma3_270m_reference.json"

TOKENIZER_TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "",
    " ",
    "  leading spaces and trailing  ",
    "a  b   c    d     e",
    "one\ntwo\n\nthree\n\n\n\nfour",
    "windows\r\nline\r\nends",
    "def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n",
    "if x:\n\tif y:\n\t\treturn {'k': [1, 2, 3]}\n\telse:\n\t\tpass  # tab-indented\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    "Café, naïve, façade, Übermaß, smörgåsbord, jalapeño.",
    "日本語のテキストと中文文本，还有한국어 문장。",
    "Привет, мир! Καλημέρα κόσμε. مرحبا بالعالم. שלום עולם.",
    "Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ 🧑‍💻✨",
    "Numbers: 0 7 42 3.14159 -2.5e-10 1,000,000 123456789012345678901234567890",
    "Dates 2024-03-15T12:34:56Z, phone +1 (555) 010-9999, 50% off, $19.99",
    "https://example.com/path?q=gemma&lang=en#section-2",
    "<b>bold</b> and <code>x = 1</code> in <div>HTML</div>",
    "Special strings: <start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "A literal <bos> in text, and <eos> too.",
    "math: ∀x∈ℝ, x² ≥ 0; ∑_{i=1}^{n} i = n(n+1)/2 → ∞",
    "rare chars: \u0007 \ue000 𠀀 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \u200b zero-width",
    "The ▁ character itself, and ▁▁ twice.",
    "    indented four\n        eight\n\t\tmixed\t tabs \t and spaces",
    "SHOUTING AND camelCaseIdentifiers and snake_case_names_here",
    "\n\n\n\n\n\n\n\n\n\n",
    "tabs\t\t\t\tend",
]

LOGPROB_TEXTS = [
    ("prose", "The lighthouse keeper had lived on the island for thirty years, and in all that time he had never "
              "missed a single night. Every evening, as the sun sank below the horizon, he climbed the spiral "
              "staircase, trimmed the wick, and watched the beam sweep across the dark water. Ships passed, "
              "storms came and went, and the keeper grew old, but the light never failed."),
    ("code", "def merge_sorted(left, right):\n"
             "    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"
             "    result = []\n"
             "    i = j = 0\n"
             "    while i < len(left) and j < len(right):\n"
             "        if left[i] <= right[j]:\n"
             "            result.append(left[i])\n"
             "            i += 1\n"
             "        else:\n"
             "            result.append(right[j])\n"
             "            j += 1\n"),
    ("prose", "Photosynthesis is the process by which green plants, algae and some bacteria convert light energy "
              "into chemical energy. Using sunlight, water and carbon dioxide, these organisms produce glucose "
              "and release oxygen as a by-product. The reactions take place mainly in the chloroplasts, where "
              "the pigment chlorophyll absorbs red and blue light."),
    ("code", "import json\n"
             "from pathlib import Path\n\n\n"
             "class Config:\n"
             "    def __init__(self, path: Path):\n"
             "        self.path = path\n"
             "        self.values = {}\n\n"
             "    def load(self) -> dict:\n"
             "        with open(self.path) as f:\n"
             "            self.values = json.load(f)\n"
             "        return self.values\n"),
]
GREEDY_TOKENS = 16

# Extra texts for --compare-tokenizer (besides the standard library's sources).
CORPUS = TOKENIZER_TEXTS + [t for _, t in LOGPROB_TEXTS] + [
    "Il était une fois, dans un pays lointain, une princesse qui aimait les étoiles.",
    "Der schnelle braune Fuchs springt über den faulen Hund. Straße, Größe, Fußgänger.",
    "¿Dónde está la biblioteca? ¡Qué día tan bonito!",
    "हिन्दी में एक वाक्य। বাংলা বাক্য। தமிழ் வாக்கியம்.",
    "ภาษาไทยไม่มีช่องว่างระหว่างคำ",
    "Tiếng Việt có nhiều dấu: ả, ẫ, ự, ỡ.",
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name ORDER BY 2 DESC;",
    "fn main() {\n    let v: Vec<i32> = (1..=10).map(|x| x * x).collect();\n    println!(\"{:?}\", v);\n}\n",
    "#include <stdio.h>\nint main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    "   \t \n \t\t  \n\n   x",
]


def fingerprint(name: str, t) -> dict:
  """Shape, sums and the values at 16 fixed flat indices of a float32 tensor."""
  import numpy as np
  a = t.detach().to("cpu").float().numpy().reshape(-1)
  n = a.size
  spread = {(k * (n - 1)) // 7 for k in range(8)}
  idx = sorted(spread | set(np.random.default_rng(0).integers(0, n, 8).tolist()))
  return {"name": name, "shape": list(t.shape), "sum": float(a.astype(np.float64).sum()),
          "abs_sum": float(np.abs(a.astype(np.float64)).sum()), "index": idx,
          "values": [float(a[i]) for i in idx]}


def record_tokenizer(tok) -> dict:
  import random
  cases = []
  for text in TOKENIZER_TEXTS:
    ids = tok.encode(text)                          # with <bos>, as the GGUF asks (add_bos_token)
    cases.append({"text": text, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=True)})
  rng = random.Random(0)
  V = len(tok)
  byte_a = tok.convert_tokens_to_ids("<0xE6>")     # the first byte of a three-byte character, alone
  decode_ids = [
      [rng.randrange(256, V) for _ in range(40)],
      [2, 9259, 1902, 1, 106, 105, 0],
      [byte_a, byte_a + 1, 9259],
      [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "né 😀".encode()],
  ]
  decodes = [{"ids": ids, "skip_special": tok.decode(ids, skip_special_tokens=True),
              "keep_special": tok.decode(ids, skip_special_tokens=False)} for ids in decode_ids]
  return {"add_bos_token": bool(getattr(tok, "add_bos_token", True)), "bos_token_id": tok.bos_token_id,
          "eos_token_id": tok.eos_token_id, "vocab_size": V, "encode_cases": cases, "decode_cases": decodes}


def record_logprobs(model, tok) -> list[dict]:
  import torch
  out = []
  greedy_left = {"prose": 1, "code": 1}
  for kind, text in LOGPROB_TEXTS:
    ids = tok.encode(text)
    with torch.no_grad():
      logits = model(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    row = {"kind": kind, "text": text, "ids": ids,
           "logprobs": [float(logp[j, ids[j + 1]]) for j in range(len(ids) - 1)],
           "argmax": [int(i) for i in logp.argmax(-1)]}
    if greedy_left[kind]:
      greedy_left[kind] -= 1
      seq, lps = list(ids), []
      for _ in range(GREEDY_TOKENS):
        with torch.no_grad():
          last = torch.log_softmax(model(torch.tensor([seq])).logits[0, -1].float(), dim=-1)
        nxt = int(last.argmax())
        seq.append(nxt)
        lps.append(float(last[nxt]))
      row["greedy_ids"], row["greedy_logprobs"] = seq[len(ids):], lps
    out.append(row)
    print(f"[record] {kind}: {len(ids)} tokens", file=sys.stderr)
  return out


def config_fields(cfg) -> dict:
  keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "sliding_window",
          "query_pre_attn_scalar", "hidden_activation", "attn_logit_softcapping", "final_logit_softcapping",
          "tie_word_embeddings", "layer_types", "rope_parameters", "bos_token_id", "eos_token_id")
  return {k: getattr(cfg, k, None) for k in keys}


def record(gguf: Path, out: Path) -> None:
  import torch
  import transformers
  from transformers import AutoModelForCausalLM, AutoTokenizer
  tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
  model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                               attn_implementation="eager").eval()
  result = {"gguf": gguf.name, "transformers": transformers.__version__, "torch": torch.__version__,
            "tokenizer": record_tokenizer(tok), "config": config_fields(model.config),
            "params": [fingerprint(n, t) for n, t in model.state_dict().items()],
            "logprobs": record_logprobs(model, tok)}
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, ensure_ascii=False, indent=1) + "\n")
  print(f"[record] wrote {out}", file=sys.stderr)


def compare_tokenizer(gguf: Path, ours_json: Path, max_files: int) -> None:
  import tokenizers
  from transformers import AutoTokenizer
  ref = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
  ours = tokenizers.Tokenizer.from_str(ours_json.read_text())
  stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))[:max_files]
  texts = CORPUS + [p.read_text(errors="replace") for p in stdlib]
  same_texts = same_decodes = tokens = diff_tokens = 0
  for text in texts:
    want = ref.encode(text, add_special_tokens=False)
    got = ours.encode(text, add_special_tokens=False).ids
    tokens += len(want)
    if got == want:
      same_texts += 1
    else:
      diff_tokens += sum(a != b for a, b in zip(got, want)) + abs(len(got) - len(want))
      print(f"[compare] differs: {text[:60]!r}", file=sys.stderr)
    same_decodes += ours.decode(want, skip_special_tokens=True) == ref.decode(want, skip_special_tokens=True)
  print(json.dumps({"texts": len(texts), "stdlib_files": len(stdlib), "reference_tokens": tokens,
                    "texts_identical": same_texts, "decodes_identical": same_decodes,
                    "tokens_differing": diff_tokens}))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--gguf", type=Path,
                  default=Path.home() / ".cache/specjax/models/gemma3-270m/gemma-3-270m-q4_k_m.gguf")
  ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
  ap.add_argument("--compare-tokenizer", type=Path, default=None, metavar="FILE")
  ap.add_argument("--max-files", type=int, default=400, help="standard library files for --compare-tokenizer")
  args = ap.parse_args(argv)
  if not args.gguf.is_file():
    ap.error(f"{args.gguf} is not a file: fetch it first with specjax's Python (python -c \"from "
             "specjax.checkpoints import fetch; fetch('gemma3-270m')\") or pass --gguf")
  if args.compare_tokenizer is not None:
    compare_tokenizer(args.gguf, args.compare_tokenizer, args.max_files)
  else:
    record(args.gguf, args.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
