"""Record published-layout EAGLE-3 drafters, written by their projects' own code, and their logits, for
tests/checkpoints/test_eagle3_layout.py.

Two layouts, each run in the environment that has its package (neither is a specjax dependency):

  specforge    SpecForge's ``LlamaForCausalLMEagle3`` (``midlayer.*``, ``d2t``/``t2d``, its ``eagle_config``),
               the layout of the original EAGLE-3 release and of AngelSlim.  Target: the tiny Llama of
               tests/data/hf_families/llama (3 layers); capture layers given in the config, [1, 0, 1] (each the
               output of that layer, as SpecForge's SGLang capture reads them; repeats allowed; the last
               layer avoided: transformers' last hidden state is after the final norm, SGLang's before); a draft vocabulary of 96
               tokens; its own embedding (not the target's); its own MLP width.
                 /tmp/hfref/bin/pip install --no-deps specforge==0.2.0      # beside torch, transformers 5.25
                 TORCHDYNAMO_DISABLE=1 /tmp/hfref/bin/python scripts/record_eagle3_references.py specforge
  speculators  ``speculators`` 0.9.0's ``Eagle3DraftModel`` (``layers.0.*``, its ``speculators_config``), saved
               with ``save_pretrained``.  Target: the tiny Gemma 3 of tests/data/hf_families/gemma3 (7 layers);
               no capture layers in the config (the package's default, hidden-state indices [2, L//2, L-3]);
               a Qwen3 layer (q/k norms); ``norm_before_residual`` and ``fc_norm`` on; a vocabulary of 120.
               speculators pins transformers <= 5.19 and pulls datasets and openai: its own venv,
                 python3 -m venv /tmp/specref && /tmp/specref/bin/pip install torch==2.13.0 'transformers<=5.19' \\
                   safetensors pydantic pyyaml openai 'datasets<=5.1.0' hs-connectors loguru pydantic-settings
                 /tmp/specref/bin/pip install --no-deps speculators==0.9.0
                 /tmp/specref/bin/python scripts/record_eagle3_references.py speculators

  speculators-export  the head in tests/data/eagle3/exported, written by specjax's exporter
               (``.venv/bin/python tests/helpers/eagle3_export_fixture.py``), read by speculators' ``from_pretrained``:
                 /tmp/specref/bin/python scripts/record_eagle3_references.py speculators-export

Recorded, float32, teacher-forced as both projects train (the input at step i is the text's token i + 1 places
on): the draft logits over the draft vocabulary at a few positions for three steps (step 0 from the target's
features, steps 1 and 2 feeding the layer's own output back), and their top-1 tokens as target ids.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from hf_family_target import draft_vocab as _draft_vocab, family_target  # noqa: E402

OUT = ROOT / "tests" / "data" / "eagle3"
POSITIONS = [5, 19, 40, 71, 90]      # index t of the pair (feature t, token t + 1); steps read up to t + 3
STEPS = 3


def _randomize(model, skip=()) -> None:
  torch.manual_seed(11)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name in skip:
        continue
      p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) * p.shape[-1] ** -0.5)


def _cases(step_logits: list[torch.Tensor], d2t: torch.Tensor) -> list[dict]:
  out = []
  for t in POSITIONS:
    logits = [s[0, t] for s in step_logits]
    top = [int(torch.argmax(x)) for x in logits]
    out.append({"t": t, "logits": [x.tolist() for x in logits], "top1_target": [d + int(d2t[d]) for d in top]})
  return out


def record_specforge() -> None:
  from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3, prepare_decoder_attention_mask
  base, ids = family_target("llama")
  c = base.config
  config = transformers.LlamaConfig(
      hidden_size=c.hidden_size, intermediate_size=96, num_attention_heads=c.num_attention_heads,
      num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, num_hidden_layers=1,
      vocab_size=c.vocab_size, rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_position_embeddings,
      rope_parameters=dict(c.rope_parameters), pad_token_id=0, hidden_act="silu")
  config.architectures = ["LlamaForCausalLMEagle3"]
  config.draft_vocab_size = 96
  config.eagle_config = {"eagle_aux_hidden_state_layer_ids": [1, 0, 1]}
  drafter = LlamaForCausalLMEagle3(config).eval()
  _randomize(drafter)
  d2t, t2d = _draft_vocab(c.vocab_size, 96, seed=3)
  drafter.d2t.copy_(d2t)
  drafter.t2d.copy_(t2d)
  x = torch.tensor([ids])
  with torch.no_grad():
    hs = base(input_ids=x, output_hidden_states=True).hidden_states
    aux = torch.cat([hs[i + 1] for i in config.eagle_config["eagle_aux_hidden_state_layer_ids"]], -1)
    n = x.shape[1] - 1                                   # pairs (feature t, token t + 1), t < n
    hidden = drafter.project_hidden_states(aux[:, :n])
    mask = prepare_decoder_attention_mask(torch.ones(1, n, dtype=torch.bool), (1, n), hidden, 0)
    cache, steps = [[], []], []
    for i in range(STEPS):                                # SpecForge's training loop (algorithms/eagle3)
      tokens = torch.cat([x[:, 1 + i:], x.new_zeros(1, i)], 1)[:, :n]
      hidden = drafter.backbone(input_embeds=drafter.embed_input_ids(tokens), hidden_states=hidden,
                                cache_hidden=cache, attention_mask=mask, position_ids=torch.arange(n)[None])
      steps.append(drafter.compute_logits(hidden))
  _save(OUT / "specforge", drafter, config.to_dict(), "specforge 0.2.0", _cases(steps, d2t), ids)


def record_speculators() -> None:
  from speculators import SpeculatorsConfig, VerifierConfig
  from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
  from speculators.proposals.greedy import GreedyTokenProposalConfig
  base, ids = family_target("gemma3")
  c = base.config
  layer = transformers.Qwen3Config(
      hidden_size=c.hidden_size, intermediate_size=80, num_attention_heads=c.num_attention_heads,
      num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, num_hidden_layers=1,
      vocab_size=c.vocab_size, rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_position_embeddings,
      rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
  layer._attn_implementation = "eager"
  config = Eagle3SpeculatorConfig(
      transformer_layer_config=layer, draft_vocab_size=120, norm_before_residual=True, fc_norm=True,
      speculators_config=SpeculatorsConfig(
          algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig()], default_proposal_method="greedy",
          verifier=VerifierConfig(name_or_path=None, architectures=["Gemma3ForCausalLM"])))
  drafter = Eagle3DraftModel(config).eval()
  _randomize(drafter, skip=("embed_tokens.weight",))
  d2t, t2d = _draft_vocab(c.vocab_size, 120, seed=5)
  with torch.no_grad():
    drafter.embed_tokens.weight.copy_(base.model.embed_tokens.weight)     # unscaled, as the package loads it
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
  L = c.num_hidden_layers
  layer_ids = [2, L // 2, L - 3]                      # the package's default: hidden-state indices
  x = torch.tensor([ids])
  steps = []
  hook = drafter.lm_head.register_forward_hook(lambda m, i, o: steps.append(o.detach().clone()))
  with torch.no_grad():
    hs = base(input_ids=x, output_hidden_states=True).hidden_states
    aux = torch.cat([hs[i] for i in layer_ids], -1)
    n = x.shape[1] - 1
    drafter(hidden_states=aux[:, :n], input_ids=x[:, 1:n + 1], document_ids=torch.zeros(1, n, dtype=torch.long),
            ttt_steps=STEPS)
  hook.remove()
  out = OUT / "speculators"
  drafter.save_pretrained(out)
  (out / "config.py").unlink(missing_ok=True)      # the package's own source, copied for remote code: not ours to keep
  config_dict = json.loads((out / "config.json").read_text())
  _save(out, None, config_dict, "speculators 0.9.0", _cases(steps, d2t), ids)


def record_speculators_export() -> None:
  """The head specjax's exporter wrote (tests/helpers/eagle3_export_fixture.py) read by ``speculators``'
  ``from_pretrained``; its logits recorded beside it."""
  import shutil
  import tempfile
  from speculators.models.eagle3 import Eagle3DraftModel
  out = OUT / "exported"
  base, ids = family_target("gemma3")
  config = json.loads((out / "config.json").read_text())
  tmp = Path(tempfile.mkdtemp())         # the package reads its verifier's config: the target, saved beside it
  base.save_pretrained(tmp / "target")
  shutil.copytree(out, tmp / "drafter")
  (tmp / "drafter" / "config.json").write_text(json.dumps(
      {**config,      # (eager attention: flex attention's block masks assume GPU-sized blocks)
       "transformer_layer_config": {**config["transformer_layer_config"], "attn_implementation": "eager"},
       "speculators_config": {**config["speculators_config"],
                                        "verifier": {"name_or_path": str(tmp / "target"),
                                                     "architectures": ["Gemma3ForCausalLM"]}}}))
  drafter = Eagle3DraftModel.from_pretrained(tmp / "drafter").eval()
  x = torch.tensor([ids])
  steps = []
  hook = drafter.lm_head.register_forward_hook(lambda m, i, o: steps.append(o.detach().clone()))
  with torch.no_grad():
    hs = base(input_ids=x, output_hidden_states=True).hidden_states
    aux = torch.cat([hs[i] for i in config["eagle_aux_hidden_state_layer_ids"]], -1)
    n = x.shape[1] - 1
    drafter(hidden_states=aux[:, :n], input_ids=x[:, 1:n + 1], document_ids=torch.zeros(1, n, dtype=torch.long),
            ttt_steps=STEPS)
  hook.remove()
  _save(out, None, config, "speculators 0.9.0 (reading specjax's export)", _cases(steps, drafter.d2t), ids)


def _save(out: Path, drafter, config: dict, package: str, cases: list[dict], ids) -> None:
  out.mkdir(parents=True, exist_ok=True)
  if drafter is not None:
    save_file({k: v.detach().clone().contiguous() for k, v in drafter.state_dict().items()},
              str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=1, default=str))
  (out / "reference.json").write_text(json.dumps({
      "package": package, "torch": torch.__version__, "transformers": transformers.__version__,
      "token_ids": list(ids), "steps": STEPS, "cases": cases}))
  print(out, [(c["t"], c["top1_target"]) for c in cases])


if __name__ == "__main__":
  {"specforge": record_specforge, "speculators": record_speculators,
   "speculators-export": record_speculators_export}[sys.argv[1]]()
