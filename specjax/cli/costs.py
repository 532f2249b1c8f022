"""The ``calibrate`` and ``cost`` commands: this machine's roofline and the cost model's predictions."""
from __future__ import annotations

from specjax.cli import common, flags


REGIMES = ("xla", "eager")     # devices.REGIMES (tests/measure/test_projection.py keeps them equal)


def register(sub) -> dict:
  """Add the calibrate, cost parsers; returns their commands."""
  cal = sub.add_parser("calibrate", help="measure this machine's roofline (bandwidth, matmul, step floor) for "
                                         "the cost model; saved in the cache and reused")
  cal.add_argument("--force", action="store_true", help="measure again even if a calibration exists")
  cal.add_argument("--out", default=None, help="write the calibration JSON here instead of the cache")
  cal.add_argument("--json", action="store_true")

  co = sub.add_parser("cost", help="the cost model's prediction: step time, bound, speculative speedup, the KV "
                                   "bill and the largest batch that fits a memory budget")
  co.add_argument("--model", default="smollm2-135m",
                  help="registry name, a .gguf file or a Hugging Face directory: only its config is read (a "
                       "directory holding config.json alone will do)")
  co.add_argument("--draft-model", default=None,
                  help="a draft model's config for its step cost, weights and KV (default: the registry's draft for "
                       "--model, e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b; 'none': no draft model)")
  co.add_argument("--device", default=None,
                  help="a published spec (h100-sxm, h200, a100-sxm-80gb, tpu-v5e) or a calibration JSON; "
                       "default: this machine, calibrated")
  co.add_argument("--regime", default="xla", choices=REGIMES,
                  help="how the implementation issues its kernels, which sets the latency floors of a published "
                       "spec: xla (default: one compiled program, as specjax runs) or eager (PyTorch eager, "
                       "as Hugging Face and Spec-Bench run; floors fitted to Spec-Bench's A100 leaderboard)")
  co.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                  help="auto: bfloat16 on a published accelerator spec, float32 on this machine's calibration")
  co.add_argument("--batch-size", type=flags.COUNT, nargs="+", default=[1, 2, 4, 8, 16, 32])
  co.add_argument("--k", type=flags.NONNEG, default=4)
  co.add_argument("--context", type=flags.COUNT, default=256)
  co.add_argument("--acceptance", type=flags.FRACTION, nargs="+", default=[0.6],
                  help="per-position acceptance α_1 α_2 ... (the last repeats)")
  co.add_argument("--max-len", type=flags.COUNT, default=2048, help="KV slots per sequence for the bill")
  co.add_argument("--memory-budget", type=flags.POSITIVE, default=None,
                  help="GiB per device for weights + KV (default: the device's)")
  co.add_argument("--mesh", default=None, help="DATAxMODEL: the target (and draft) sharded over that many "
                                                "devices: per-device share + all-reduce communication per step")
  co.add_argument("--weights", type=flags.weight_kinds, default=["fp32"],
                  help="weight types, comma-separated (fp32,bf16,int8,int4): the bytes each step reads and, on "
                       "a calibrated CPU, its kernels' unpacking cost; the table is the first, and with several "
                       "a second table gives each type's verify cost for 1..32 rows and its crossover batch")
  co.add_argument("--draft-weights", type=flags.weight_kind, default=None,
                  help="the draft model's weight type (default: the target's)")
  co.add_argument("--json", action="store_true")
  return {"calibrate": cmd_calibrate, "cost": cmd_cost}


def cmd_calibrate(args) -> int:
  from specjax.measure import calibrate
  rec = calibrate.calibrate(path=args.out, force=args.force, log=common.log)

  def human(r):
    sp, pr = r["spec"], r["probes"]
    print(f"{sp['name']}\n  stream bandwidth {sp['mem_bandwidth'] / 1e9:.1f} GB/s (raw DRAM probe best "
          f"{pr['raw_read_gb_per_s']['best']:.1f} GB/s)\n  matmul {sp['peak_flops']['float32'] / 1e9:.1f} "
          f"GFLOP/s fp32\n  floor {sp['floor_s'] * 1e6:.0f} µs + {sp['floor_per_layer_s'] * 1e6:.1f} µs per layer"
          f"\n  ridge {sp['peak_flops']['float32'] / sp['mem_bandwidth']:.1f} FLOP/byte")
  common.emit(rec, args.json, human)
  return 0


def cmd_cost(args) -> int:
  from specjax.measure import costmodel, memory
  from specjax.measure import calibrate
  from specjax.errors import SpecjaxError
  if args.regime != "xla" and args.device not in costmodel.DEVICES:
    raise SpecjaxError(f"--regime {args.regime} sets a published spec's floors: give --device one of "
                       f"{', '.join(costmodel.DEVICES)} (a calibration measures this machine's own xla floors)")
  cfg = common.model_config(args.model)
  if args.draft_model is None:
    from specjax.checkpoints import catalog as registry
    args.draft_model = registry.default_draft(args.model)
  dcfg = common.model_config(args.draft_model) if args.draft_model and args.draft_model != "none" else None
  spec = costmodel.in_regime(calibrate.load_or_calibrate(args.device, log=common.log), args.regime)
  if args.dtype == "auto":
    args.dtype = "bfloat16" if args.device in costmodel.DEVICES else "float32"
  if args.k < 0:
    raise SpecjaxError(f"--k must be >= 0, got {args.k}")
  mesh = costmodel.MeshShape.of(args.mesh)
  budget = (args.memory_budget * 2**30 if args.memory_budget else spec.memory_bytes) * mesh.devices
  w0, dw = args.weights[0], args.draft_weights
  rows = []
  for B in args.batch_size:
    plain = costmodel.breakdown(spec, cfg, B, 1, args.context, args.dtype, mesh=mesh, weights=w0)
    ver = costmodel.breakdown(spec, cfg, B, args.k + 1, args.context, args.dtype, mesh=mesh, weights=w0)
    rows.append({"batch": B, "plain_ms": plain["predicted_s"] * 1e3, "plain_bound": plain["bound"],
                 "verify_ms": ver["predicted_s"] * 1e3, "verify_bound": ver["bound"],
                 **({"plain_comm_ms": plain["comm_s"] * 1e3, "verify_comm_ms": ver["comm_s"] * 1e3}
                    if mesh.model > 1 else {}),
                 "tau": costmodel.expected_accepted(args.acceptance, args.k),
                 "predicted_speedup": costmodel.predicted_speedup(spec, cfg, args.acceptance, args.k, B,
                                                                  args.context, args.dtype, dcfg, mesh=mesh,
                                                                  weights=w0, draft_weights=dw)})
  plain_bill = memory.mesh_bill(memory.kv_bill(cfg, args.max_len, 0, None, args.dtype, weights=w0), mesh)
  spec_bill = memory.mesh_bill(memory.kv_bill(cfg, args.max_len, args.k, dcfg, args.dtype, weights=w0,
                                              draft_weights=dw), mesh)
  out = {"device": spec.to_dict(), "model": cfg.name, "mesh": str(mesh), "k": args.k, "weights": w0,
         "draft_weights": dw or w0, "acceptance": args.acceptance, "context": args.context, "rows": rows,
         "crossover_batch": costmodel.crossover_batch(spec, cfg, args.acceptance, args.k, args.batch_size,
                                                      args.context, args.dtype, dcfg, mesh=mesh, weights=w0,
                                                      draft_weights=dw),
         "memory_budget_bytes": budget, "max_len": args.max_len,
         "max_batch_plain": memory.max_batch(budget, plain_bill),
         "max_batch_speculative": memory.max_batch(budget, spec_bill),
         "per_seq_bytes_plain": plain_bill.per_seq, "per_seq_bytes_speculative": spec_bill.per_seq}
  if len(args.weights) > 1:
    out["by_weights"] = [_weights_row(spec, cfg, dcfg, args, kind, mesh) for kind in args.weights]

  def human(o):
    from specjax.eval.report import print_table
    print_table(o["rows"], title=f"{o['model']} on {spec.name} ({spec.regime})" + (
                    f" × {o['mesh']} mesh" if o["mesh"] != "1x1" else "") +
                f": k={o['k']}, context {o['context']}, α={o['acceptance']}")
    print(f"speculation stops paying at batch {o['crossover_batch']}" if o["crossover_batch"] else
          "speculation pays at every batch size listed")
    print(f"memory budget {memory.fmt_bytes(budget)}, {o['max_len']} slots per sequence: max batch "
          f"{o['max_batch_plain']} plain ({memory.fmt_bytes(plain_bill.per_seq)}/seq), "
          f"{o['max_batch_speculative']} speculative ({memory.fmt_bytes(spec_bill.per_seq)}/seq)")
    if "by_weights" in o:
      print_table([{k: v for k, v in r.items() if k != "verify_ms"} | {f"T{t}": v for t, v in r["verify_ms"].items()}
                   for r in o["by_weights"]],
                  title=f"by weight type (batch 1; verify ms for T rows; the draft at {dw or 'the same type'})")
  common.emit(out, args.json, human)
  return 0


VERIFY_ROWS = (1, 2, 4, 8, 16, 32)


def _weights_row(spec, cfg, dcfg, args, kind: str, mesh) -> dict:
  """One weight type's predictions: the bytes, the verify cost for 1..32 rows at batch 1, the speedup at batch
  1 and the crossover batch (the draft at ``--draft-weights`` or the same type)."""
  from specjax.measure import costmodel, memory
  t = lambda T: costmodel.step_time(spec, cfg, 1, T, args.context, args.dtype, mesh=mesh, weights=kind)
  dw = args.draft_weights or kind
  return {"weights": kind, "weight_gb": memory.weight_bytes(cfg, costmodel.DTYPE_BYTES[args.dtype], kind) / 1e9,
          "verify_ms": {T: t(T) * 1e3 for T in VERIFY_ROWS},
          "speedup_b1": costmodel.predicted_speedup(spec, cfg, args.acceptance, args.k, 1, args.context, args.dtype,
                                                    dcfg, mesh=mesh, weights=kind, draft_weights=dw),
          "crossover_batch": costmodel.crossover_batch(spec, cfg, args.acceptance, args.k, args.batch_size,
                                                       args.context, args.dtype, dcfg, mesh=mesh, weights=kind,
                                                       draft_weights=dw)}
