"""Command-line front end shared by ``python -m experiments.<dataset>``.

Each flag sets one leaf of `fedjax_hetero.config.RunConfig` (the flag's name
without dashes is the leaf's flag name, see `RunConfig.from_flags`); a dataset
module supplies its own defaults (its preset) and calls `main`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace
from typing import Any, NoReturn, Sequence

from experiments.presets import PRESETS, get_preset, paper_deviations
from fedjax_hetero import aggregators
from fedjax_hetero import data as fdata
from fedjax_hetero import distributed
from fedjax_hetero import models
from fedjax_hetero import os_errors
from fedjax_hetero.aggregators import fedcross
from fedjax_hetero.algorithms.fedgen import PRESETS as FEDGEN_PRESETS
from fedjax_hetero.algorithms.fedimpro import LOSS_MODES, SAMPLE_SOURCES
from fedjax_hetero.algorithms import fedin
from fedjax_hetero.backends import BACKENDS
from fedjax_hetero.client.backdoor import READINGS
from fedjax_hetero.client.local import OPTIMIZERS
from fedjax_hetero.compilation import CACHE_ENV, default_cache_dir, enable_persistent_cache
from fedjax_hetero.config import NORMALIZATIONS, RunConfig
from fedjax_hetero.engine import AUTO_ROUNDS_PER_CALL, ROUND_PROGRAMS
from fedjax_hetero.guard import ACTIONS
from fedjax_hetero.methods import AGGREGATE_MODES, methods_by_paper
from fedjax_hetero.methods.heterofl import BN_SAMPLES
from fedjax_hetero.models.resnet import SKIPS
from fedjax_hetero.runner import run_experiment
from fedjax_hetero.sampling import SIMILARITIES
from fedjax_hetero.sampling.samplers import WEIGHTINGS


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
  """Flag defaults in the help, and the method list (the epilog) kept as written."""


def methods_help() -> str:
  """The methods grouped by paper, one line each."""
  lines = ["methods (--method, case-insensitive), by paper:"]
  for paper, entries in methods_by_paper().items():
    lines.append(f"  {paper}:")
    lines += [f"    {e.name:<15} {e.summary}" for e in entries]
  return "\n".join(lines)


def build_parser(defaults: RunConfig, description: str) -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=description, formatter_class=_HelpFormatter, epilog=methods_help())
  d = SimpleNamespace(**defaults.flags())
  p.add_argument("--method", default=d.method, help="federated method by its paper name (listed below)")
  p.add_argument("--groups", default=",".join(d.groups), type=_group_list,
                 help="comma-separated architecture groups, smallest first, each NAME or NAME@WIDTH; "
                 f"names: {', '.join(models.MODEL_NAMES)}. Clients are split into equal contiguous blocks, "
                 "one per group")
  p.add_argument("--group-draw", default=",".join(map(str, d.group_draw)), type=_probabilities,
                 help="comma-separated probabilities, one per group: every round each client's group is drawn "
                 "afresh from them (HeteroFL's dynamic a1-b1-... mode; e.g. 0.5,0.5); empty: every client keeps "
                 "the group of its block")
  p.add_argument("--data-dir", default=d.data_dir, help="directory holding the dataset files "
                 "(Fashion-MNIST IDX files, or prepared tfds data); default: the system/tfds locations")
  p.add_argument("--num-clients", type=int, default=d.num_clients, help="number of simulated clients")
  p.add_argument("--clients-per-round", type=int, default=d.clients_per_round, help="clients sampled per round")
  p.add_argument("--partition", default=d.partition, choices=fdata.SCHEMES, help="how data is split over clients")
  p.add_argument("--alpha", type=float, default=d.alpha, help="Dirichlet concentration (partition=dirichlet)")
  p.add_argument("--classes-per-client", type=int, default=d.classes_per_client,
                 help="classes per client (partition=shards)")
  p.add_argument("--epochs", type=int, default=d.epochs, help="local epochs per round")
  p.add_argument("--batch-size", type=int, default=d.batch_size, help="local batch size")
  p.add_argument("--optimizer", default=d.optimizer, choices=OPTIMIZERS,
                 help="client optimizer, created fresh every round")
  p.add_argument("--lr", dest="learning_rate", type=float, default=d.learning_rate, help="client learning rate")
  p.add_argument("--momentum", type=float, default=d.momentum, help="SGD momentum")
  p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="decoupled weight decay")
  p.add_argument("--drop-last", action=argparse.BooleanOptionalAction, default=d.drop_last,
                 help="drop each epoch's partial last batch (InCo's code) instead of masking it")
  p.add_argument("--rounds", type=int, default=d.rounds, help="communication rounds")
  p.add_argument("--eval-every", type=int, default=d.eval_every, help="evaluate every N rounds (and the last)")
  p.add_argument("--seed", type=int, default=d.seed, help="seed of partition, sampling, init and shuffling")
  p.add_argument("--sample-seed", type=int, default=d.sample_seed,
                 help="seed of the rounds' cohorts alone (partition, init and shuffling keep --seed); default: --seed")
  p.add_argument("--output-dir", default=d.output_dir, help="results folder")
  p.add_argument("--resume", action="store_true",
                 help="continue from the last checkpoint in --output-dir; the other settings must match its "
                      "config.json, except the round counts, --backend, --steps-per-call, --data-dir and the local "
                      "optimizer")
  p.add_argument("--overwrite", action="store_true",
                 help="delete --output-dir first if it holds a run (config.json, metrics.jsonl or checkpoints/); "
                 "a folder of other files is refused")
  # Reliability (issue 35, fedjax_hetero.results_folder / metrics_log).
  p.add_argument("--resume-unchecked", action="store_true",
                 help="with --resume: continue a folder whose config.json (and summary.json) cannot be read or is "
                 "gone, or whose data fingerprint differs, with this command's settings, unchecked (the unreadable "
                 "files are kept as *.unreadable)")
  p.add_argument("--repair-metrics", action="store_true",
                 help="with --resume: rebuild a damaged metrics.jsonl: keep the rows of rounds 1..k before the first "
                 "missing one, drop the rest with a note, and train the later rounds again from the latest checkpoint "
                 "up to round k (later checkpoints are moved to dropped_checkpoints/)")
  p.add_argument("--backend", default=d.backend, choices=BACKENDS, help="how clients are mapped onto hardware")
  p.add_argument("--round-program", default=d.round_program, choices=ROUND_PROGRAMS,
                 help="fused: every round (up to --rounds-per-call of them) is one device program; host: the host "
                 "loop launches each group's programs; auto: fused on an accelerator when the method allows it "
                 "(not CluSamp), host on CPU (docs/performance.md)")
  p.add_argument("--rounds-per-call", type=int, default=d.rounds_per_call,
                 help="rounds per device program of --round-program fused (a call also ends at every checkpoint "
                 f"and the last round); default: {AUTO_ROUNDS_PER_CALL}")
  p.add_argument("--weighting", default=d.weighting, choices=WEIGHTINGS,
                 help="client weights in aggregation: uniform (InCo's code) or by sample count")
  p.add_argument("--aggregate", default=d.aggregate, choices=AGGREGATE_MODES,
                 help="average client deltas or uploaded weights (FedFA and FlexiFed always average weights)")
  p.add_argument("--prox-mu", type=float, default=d.prox_mu,
                 help="FedProx's mu in the client objective CE + mu/2 ||w - w_glob||^2 (any method); "
                 "default: the method's (--fedprox-mu for FedProx, HeteroProx, InCoProx; none for the others)")
  p.add_argument("--fedprox-mu", type=float, default=d.fedprox_mu,
                 help="mu of the methods with FedProx's term when --prox-mu is not given (InCo paper: 0.1; the "
                 "fedcross presets: 0.01, the FedCross paper's CIFAR-10 value)")
  p.add_argument("--moon-mu", type=float, default=d.moon_mu,
                 help="MOON's weight of the model-contrastive loss (any method); default: the method's "
                 "(5 for MOON, HeteroMOON, InCoMOON; none for the others)")
  p.add_argument("--moon-temperature", type=float, default=d.moon_temperature, help="MOON's temperature tau")
  fc = p.add_argument_group("FedCross (--method FedCross)")
  fc.add_argument("--fedcross-alpha", type=float, default=d.fedcross_alpha,
                  help="w_i = alpha v_i + (1 - alpha) v_partner(i)")
  fc.add_argument("--fedcross-strategy", default=d.fedcross_strategy, choices=fedcross.STRATEGIES,
                  help="collaborative-model selection: in_order ((i + r mod (K-1) + 1) mod K), or the "
                  "lowest/highest similarity among the other uploads")
  fc.add_argument("--fedcross-similarity", default=d.fedcross_similarity, choices=fedcross.SIMILARITY_KINDS,
                  help="cosine: true cosine over all parameters (the paper's intent); paper: the paper's printed "
                  "formula; layerwise: sum of per-layer cosines (the authors' code)")
  fc.add_argument("--fedcross-global", default=d.fedcross_global, choices=("middleware", "uploaded"),
                  help="global model = mean of the new middleware models (paper) or of the uploads (authors' code)")
  fc.add_argument("--fedcross-warmup-rounds", type=int, default=d.fedcross_warmup_rounds,
                  help="FedAvg warm-up of the authors' code: every middleware model := the mean before this round")
  fc.add_argument("--fedcross-propellers", type=int, default=d.fedcross_propellers,
                  help="propeller models per slot (Sec. III-D PM) during the first --fedcross-propeller-rounds")
  fc.add_argument("--fedcross-propeller-rounds", type=int, default=d.fedcross_propeller_rounds,
                  help="length of the propeller stage")
  fc.add_argument("--fedcross-dynamic-alpha-rounds", type=int, default=d.fedcross_dynamic_alpha_rounds,
                  help="dynamic alpha (Sec. III-D DA): linear 0.5 -> --fedcross-alpha over the first N rounds")
  ic = p.add_argument_group("InCo (--method InCo*)")
  ic.add_argument("--inco-variant", default=d.inco_variant, choices=aggregators.INCO_VARIANTS,
                  help="cross-layer rule: code (the authors' code: theta = clip(|b|/a, 0, 5), + theta g0, update "
                  "clipped to 0.1; reproduces the published numbers), theorem (Theorem 3.1: project only if b < 0), "
                  "paper (Alg. 1: g_k - theta g_0 always), and the Sec. 5.3 ablations no_normalization, "
                  "no_optimization (theta = 1), none (raw g_k + g_0); default: code")
  ic.add_argument("--inco-granularity", default=d.inco_granularity, choices=aggregators.INCO_GRANULARITIES,
                  help="norms and theta per 3x3 kernel slice (the authors' code) or per tensor (the paper's "
                  "reading); default: kernel")
  ff = p.add_argument_group("FedFA (--method FedFA)")
  ff.add_argument("--fedfa-graft", action=argparse.BooleanOptionalAction, default=d.fedfa_graft,
                  help="layer grafting (Alg. 2): before aggregation a shallow client's last block of a stage also "
                  "fills the stage's deeper blocks where their shapes match (not from a lone downsampling block); needs "
                  "models declaring their stages (ResNets); default: on")
  ff.add_argument("--fedfa-scale", action=argparse.BooleanOptionalAction, default=d.fedfa_scale,
                  help="scalable aggregation (Alg. 1): each client's kernels times alpha = cohort mean of ||M_95|| / "
                  "its own ||M_95||; biases and BatchNorm get alpha = 1; default: on")
  ff.add_argument("--fedfa-norm", default=d.fedfa_norm, choices=aggregators.FEDFA_NORMS,
                  help="||M_95||: l2 (the paper) or rms (l2 / sqrt(kept elements), comparable across widths); "
                  "default: l2")
  ff.add_argument("--fedfa-percentile", type=float, default=d.fedfa_percentile,
                  help="the norm keeps the weights with |w| at most this percentile of |w|; default: 95")
  hf = p.add_argument_group("HeteroFL (--method HeteroFL)")
  hf.add_argument("--heterofl-scaler", action=argparse.BooleanOptionalAction, default=d.heterofl_scaler,
                  help="the Scaler: hidden layers' outputs divided by the group's width in training (MLP, CNN, "
                  "ResNet); default: on")
  hf.add_argument("--heterofl-static-bn", action=argparse.BooleanOptionalAction, default=d.heterofl_static_bn,
                  help="static BN: no running statistics kept or averaged in training; re-estimated on training "
                  "samples before each evaluation; default: on")
  hf.add_argument("--heterofl-bn-samples", type=int, default=d.heterofl_bn_samples,
                  help=f"training samples (a fixed draw) static BN re-estimates statistics on; default: {BN_SAMPLES}")
  hf.add_argument("--heterofl-mask-logits", action=argparse.BooleanOptionalAction, default=d.heterofl_mask_logits,
                  help="in local training, zero the logits of classes absent from the client's data; default: on")
  nf = p.add_argument_group("NeFL (--method NeFL)")
  nf.add_argument("--nefl-skip", default=d.nefl_skip, choices=SKIPS,
                  help="which blocks a depth group's stage of d blocks holds of a deeper one: middle (the first "
                  "d-1 and the last, NeFL's ResNet34/110 tables) or last (the first d, FedFA's extraction); "
                  "default: middle")
  nf.add_argument("--nefl-step-sizes", action=argparse.BooleanOptionalAction, default=d.nefl_step_sizes,
                  help="learnable per-block step sizes x + s F(x), s = 1 at the start, kept per group (ResNets); "
                  "default: on")
  fn = p.add_argument_group("FedIN (--method FedIN) and InclusiveFL (--method InclusiveFL)")
  fn.add_argument("--fedin-rule", default=d.fedin_rule, choices=fedin.RULES,
                  help="how the IN gradient and the local one combine: eq14 (Z = G_IN + lambda/2 G_local, the "
                  "paper's runs), sum (G_IN + G_local: the ablation without the rule), project (Eq. 13: G_IN "
                  "projected onto <Z, G_local> >= 0 on the intermediate layers, G_local elsewhere)")
  fn.add_argument("--fedin-lam", type=float, default=d.fedin_lam, help="lambda of Eq. 14")
  fn.add_argument("--fedin-projection", default=d.fedin_projection, choices=fedin.PROJECTIONS,
                  help="Eq. 13's inner products per intermediate-layer tensor or over all of them (--fedin-rule "
                  "project)")
  fn.add_argument("--fedin-bank", default=d.fedin_bank, choices=fedin.BANK_MODES,
                  help="the server's feature bank: the latest round's pairs, or every round's (a ring buffer of "
                  "--fedin-bank-capacity pairs)")
  fn.add_argument("--fedin-bank-capacity", type=int, default=d.fedin_bank_capacity,
                  help="pairs the history bank holds, the oldest overwritten first")
  fn.add_argument("--fedin-num-pairs", type=int, default=d.fedin_num_pairs,
                  help="|S|: feature pairs each client uploads and regresses on per step (the paper: one batch, 16); "
                  "drawn with replacement from a smaller bank")
  fn.add_argument("--inclusivefl-beta", type=float, default=d.inclusivefl_beta,
                  help="InclusiveFL: a shallow group's last block of a stage moves by beta x the momentum of the "
                  "deeper blocks' update")
  fn.add_argument("--inclusivefl-momentum", type=float, default=d.inclusivefl_momentum,
                  help="InclusiveFL: momentum of the deeper blocks' mean update across rounds")
  at = p.add_argument_group("backdoor attack (FedFA's robustness experiment; works with every method)")
  at.add_argument("--malicious-fraction", type=float, default=d.malicious_fraction,
                  help="fraction of all clients that attack, a fixed set drawn from --seed and listed in "
                  "summary.json and partition.txt (0: no attack)")
  at.add_argument("--backdoor-scale", type=float, default=d.backdoor_scale,
                  help="lambda: a malicious client uploads its update plus lambda times the update of a copy "
                  "trained on its labels shuffled")
  at.add_argument("--backdoor-delta", default=d.backdoor_delta, choices=READINGS,
                  help="what lambda multiplies: 'update' (the label-shuffled copy's own update) or 'difference' "
                  "(the copy's update minus the clean one)")
  fg = p.add_argument_group("FedGen (--method FedGen) and CluSamp (--method CluSamp)")
  fg.add_argument("--fedgen-preset", default="cifar10", choices=tuple(FEDGEN_PRESETS),
                  help="FedGen's generator and regularizer hyperparameters (the FedCross framework's per-dataset "
                  "config)")
  fg.add_argument("--clusamp-similarity", default=d.clusamp_similarity, choices=SIMILARITIES,
                  help="dissimilarity of the clients' representative gradients in clustered sampling")
  fi = p.add_argument_group("FedImpro (--method FedImpro) and the gradient-dissimilarity metric")
  fi.add_argument("--fedimpro-cut", default=d.fedimpro_cut,
                  help="cut point splitting the model into low and high parts (FedImpro's shared features, and the "
                  "low/high split of the dissimilarity metric); default: the model's (cnn: conv2, ResNets: stage2)")
  fi.add_argument("--fedimpro-beta", type=float, default=d.fedimpro_beta,
                  help="momentum of the clients' per-class feature estimate (Eq. 7); 0 replaces it by every batch's "
                  "statistics, which is what the authors' code does in effect")
  fi.add_argument("--fedimpro-std-max", type=float, default=d.fedimpro_std_max,
                  help="upper clamp of the estimated feature standard deviation (the authors' code)")
  fi.add_argument("--fedimpro-weight", type=float, default=d.fedimpro_weight,
                  help="weight of the cross-entropy on synthetic features")
  fi.add_argument("--fedimpro-loss", default=d.fedimpro_loss, choices=LOSS_MODES,
                  help="concat: the mean cross-entropy over real and synthetic rows (the authors' code and the proof "
                  "of Theorem 4.2); sum: CE(real) + weight CE(synthetic) (Eq. 6 as printed)")
  fi.add_argument("--fedimpro-sample-from", default=d.fedimpro_sample_from, choices=SAMPLE_SOURCES,
                  help="draw synthetic features from the round's global estimate (Alg. 1) or from the client's "
                  "running estimate (the authors' code)")
  fi.add_argument("--fedimpro-noise", type=float, default=d.fedimpro_noise,
                  help="std of Gaussian noise on the uploaded means and deviations (the paper's privacy experiment)")
  fi.add_argument("--fedimpro-num-synthetic", type=int, default=d.fedimpro_num_synthetic,
                  help="synthetic features per local step; default: as many as the batch has real rows (the "
                  "paper's N-hat = N)")
  fi.add_argument("--dissimilarity", action=argparse.BooleanOptionalAction, default=d.dissimilarity,
                  help="log every round's gradient dissimilarity of the client updates, for the low and the high "
                  "part, per group (any method)")
  p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, help="checkpoint every N rounds")
  p.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints,
                 help="checkpoints kept: the latest N, and besides them the one with the best mean test accuracy")
  dg = p.add_argument_group("divergence guard")
  dg.add_argument("--on-divergence", default=d.on_divergence, choices=ACTIONS,
                  help="when the loss is not finite, rises above --divergence-loss-factor x its lowest, or accuracy "
                  "collapses to chance: stop (the best checkpoint is kept), rollback (restore the best checkpoint, "
                  "lower the learning rate, go on), or off (stop only on a non-finite loss)")
  dg.add_argument("--divergence-loss-factor", type=float, default=d.divergence_loss_factor,
                  help="a group's training loss above this multiple of its lowest so far (at least ln C / 2; ln C "
                  "before its first round) counts as divergence")
  dg.add_argument("--divergence-chance-evals", type=int, default=d.divergence_chance_evals,
                  help="evaluations in a row at chance accuracy (after reaching twice chance) that count as divergence")
  dg.add_argument("--divergence-rollback-lr-factor", type=float, default=d.divergence_rollback_lr_factor,
                  help="rollback multiplies the clients' learning rate by this")
  dg.add_argument("--divergence-max-rollbacks", type=int, default=d.divergence_max_rollbacks,
                  help="rollbacks allowed in the whole run (across resumes) before it stops")
  p.add_argument("--steps-per-call", type=int, default=d.steps_per_call,
                 help="local steps unrolled in one jitted call: 1 compiles fastest and is as fast for ResNets; "
                      "4 trains a full-width CNN ~6%% faster on XLA:CPU (docs/performance.md)")
  p.add_argument("--max-train-samples", type=int, default=d.max_train_samples,
                 help="use a class-balanced subset of the training set (quick runs)")
  p.add_argument("--max-test-samples", type=int, default=d.max_test_samples,
                 help="evaluate on a class-balanced random subset of the test set")
  au = p.add_argument_group("data pipeline (the InCo authors': --preset inco-authors-cpu, docs/inco_fidelity.md)")
  au.add_argument("--image-size", type=int, default=d.image_size,
                  help="resize train and test images to N x N once when loaded (bilinear, as torchvision's Resize "
                  "on tensors); default: the dataset's size")
  au.add_argument("--normalize", default=d.normalize, choices=NORMALIZATIONS,
                  help="dataset: (x - the dataset's mean) / its std; none: pixels in [0, 1] (torchvision's ToTensor "
                  "alone)")
  au.add_argument("--partition-file", default=d.partition_file, metavar="PATH",
                  help="clients' sample indices from a file instead of --partition: an .npz with one integer array "
                  "per client under the keys 0..K-1 (scripts/convert_inco_split.py writes one), or a .json list of "
                  "lists; K must equal --num-clients; samples no client holds are not used")
  au.add_argument("--test-first", type=int, default=d.test_first, metavar="N",
                  help="evaluate on the first N test images (the InCo authors': 9728, 19 batches of 512)")
  p.add_argument("--no-progress", dest="progress", action="store_false", help="hide the progress bar")
  _add_distributed_flags(p)
  return p


# The multi-process flags' destinations: how this process joins a run, not part of the run's config.
DISTRIBUTED_FLAGS = ("distributed", "coordinator", "num_processes", "process_id", "distributed_timeout",
                     "heartbeat_timeout")


def _add_distributed_flags(p: argparse.ArgumentParser) -> None:
  d = distributed.DistributedConfig()
  env = distributed.ENV
  g = p.add_argument_group(
      "multi-process runs (jax.distributed; needs --backend sharded or auto)",
      "Every process runs the same command; process 0 writes the results folder, which must be on a file\n"
      "system all processes see. python -m experiments.launch starts such a run on this machine's CPUs.")
  g.add_argument("--distributed", default=d.mode, choices=distributed.MODES,
                 help="auto: let jax.distributed.initialize detect the processes (Cloud TPU VM or pod slice, SLURM, "
                 "Open MPI); off: one process, unless --coordinator, --num-processes and --process-id are given")
  # "%(default).0s" prints nothing; it only keeps the formatter from adding "(default: None)".
  g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                 help=f"process 0's address and a free port (default: ${env['coordinator']})%(default).0s")
  g.add_argument("--num-processes", type=int, default=None, metavar="N",
                 help=f"processes in the run (default: ${env['num_processes']})%(default).0s")
  g.add_argument("--process-id", type=int, default=None, metavar="I",
                 help=f"this process's index, 0 to N-1 (default: ${env['process_id']})%(default).0s")
  g.add_argument("--distributed-timeout", type=int, default=d.timeout, metavar="SECONDS",
                 help="how long processes wait for each other to join, and at the end to finish")
  g.add_argument("--heartbeat-timeout", type=int, default=d.heartbeat_timeout, metavar="SECONDS",
                 help="a process silent this long counts as dead: the others stop with an error")


def distributed_config(args: argparse.Namespace) -> distributed.DistributedConfig:
  """The multi-process settings of parsed flags (coordinator settings not given: from the environment)."""
  return distributed.from_flags(args.distributed, args.coordinator, args.num_processes, args.process_id,
                                args.distributed_timeout, args.heartbeat_timeout)


def _group_list(text: str) -> tuple[str, ...]:
  return tuple(g.strip() for g in text.split(",") if g.strip())


def _probabilities(text: str) -> tuple[float, ...]:
  try:
    return tuple(float(p) for p in text.split(",") if p.strip())
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated probabilities, got {text!r}") from None


def config_from_args(args: argparse.Namespace, dataset: str) -> RunConfig:
  flags = {k: v for k, v in vars(args).items() if k not in DISTRIBUTED_FLAGS}
  if isinstance(flags["groups"], str):  # argparse leaves an untouched default as given
    flags["groups"] = _group_list(flags["groups"])
  if isinstance(flags["group_draw"], str):
    flags["group_draw"] = _probabilities(flags["group_draw"])
  return RunConfig.from_flags(dataset=dataset, **flags)


def _check_compile_cache(directory: str | None) -> None:
  if directory and directory.lower() != "off" and os.path.exists(directory) and not os.path.isdir(directory):
    raise ValueError(f"--compile-cache {directory!r} is a file, not a directory")


def _fail(message: str, status: int = 2) -> NoReturn:
  """The CLI's answer to a bad input: ``error: message`` on stderr and exit status 2 (argparse's), no traceback."""
  print(f"error: {message}", file=sys.stderr)
  raise SystemExit(status) from None


def _preset_defaults(defaults: RunConfig, argv: Sequence[str] | None) -> tuple[RunConfig, Any]:
  """The dataset's defaults with ``--preset``'s values applied (flags given later still win)."""
  pre = argparse.ArgumentParser(add_help=False)
  pre.add_argument("--preset", default=None)
  known, _ = pre.parse_known_args(argv)
  if known.preset is None:
    return defaults, None
  try:
    chosen = get_preset(known.preset)
  except ValueError as e:
    _fail(str(e))
  return defaults.replace(**chosen.values, output_dir=f"runs/{defaults.data.dataset}-{chosen.name}"), chosen


def main(dataset: str, defaults: RunConfig, description: str, argv: Sequence[str] | None = None,
         coarse_labels: bool = False) -> dict[str, Any]:
  """Parses flags and runs; ``coarse_labels`` adds ``--coarse`` (dataset ``<dataset>_coarse``, CIFAR-100's 20
  superclasses)."""
  defaults, chosen = _preset_defaults(defaults, argv)
  parser = build_parser(defaults, description)
  if coarse_labels:
    parser.add_argument("--coarse", action="store_true",
                        help="train on the 20 superclass labels (the FedCross authors' code) instead of the fine ones")
  parser.add_argument("--preset", default=None, choices=tuple(PRESETS), help="start from a named setting: " + "; ".join(
      f"{p.name}: {p.description}" + (f" (reduced: {p.reduced})" if p.reduced else "") for p in PRESETS.values()))
  parser.add_argument("--compile-cache", default=None, metavar="DIR",
                      help="jax's persistent compilation cache (a second run skips XLA's compilation); default "
                           f"${CACHE_ENV} or {default_cache_dir()}; 'off' turns it off")
  args = parser.parse_args(argv)
  del args.preset
  compile_cache = args.compile_cache
  del args.compile_cache
  if coarse_labels and args.coarse:
    dataset = f"{dataset}_coarse"
  vars(args).pop("coarse", None)
  try:  # every setting is checked before anything is created or computed
    config = config_from_args(args, dataset)
    processes = distributed_config(args)
    processes.check_backend(config.backend)
    config.data.check_paths()
    config.output.check_paths()
    _check_compile_cache(compile_cache)
  except ValueError as e:
    _fail(str(e))
  # In a multi-process run a process that fails exits at once (`distributed.exit_on_failure`).
  with distributed.exit_on_failure(processes.enabled):
    try:
      distributed.initialize(processes)
    except RuntimeError as e:
      _fail(str(e), distributed.FAILED)
    try:
      enable_persistent_cache(compile_cache)
    except OSError as e:
      _fail(f"--compile-cache {compile_cache!r} cannot be used: {e}")
    main_process = distributed.is_main_process() if processes.enabled else True
    if chosen is not None and main_process:
      changed = paper_deviations(chosen, config.flags())
      note = "; this run differs from the paper's protocol in: " + ", ".join(
          f"{k}={v!r} (paper {p!r})" for k, (v, p) in changed.items()) if changed else ""
      scale = "REDUCED SCALE. " if chosen.reduced else ""
      print(f"preset {chosen.name}: {scale}{chosen.description}{note}", flush=True)
    try:
      summary = run_experiment(config)
    except (ValueError, fdata.DataNotFoundError, FloatingPointError) as e:
      _fail(str(e))
    except (OSError, MemoryError) as e:  # reliability hook (issue 35): one line for every OS error
      _fail(os_errors.describe(e, f"(writing in --output-dir {config.output.dir!r})"), 1)
    if main_process:
      final = summary["final_accuracy"] or {}
      print(json.dumps({"final_accuracy": final, "best_mean_accuracy": summary["best_mean_accuracy"],
                        "train_seconds": round(summary["train_seconds_all_rounds"], 1),
                        "output_dir": config.output.dir}, indent=1))
  return summary


def preset(**flags: Any) -> RunConfig:
  """A dataset module's defaults: the library's, with these flags changed."""
  return RunConfig.from_flags(**flags)
