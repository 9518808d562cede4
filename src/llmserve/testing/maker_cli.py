"""`llmserve make-model`: its flags and handler; the checkpoint writer (and torch) loads when it runs."""

from __future__ import annotations

import argparse

from llmserve.model.shapes import ARCHS, DTYPE_NAMES, SHAPES


def add_make_model_parser(subparsers) -> argparse.ArgumentParser:
    """Add `make-model`; the parsed args carry `func` (call it with the args; returns an exit code)."""
    parser = subparsers.add_parser("make-model", help="write a random-weight checkpoint (no download)")
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--shape", choices=list(SHAPES), default="tiny")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=list(DTYPE_NAMES), default="float32")
    parser.add_argument("--quantization", choices=["fp8", "fp8-channel"], default=None,
                        help="write Linear weights in FP8: fp8 = transformers' format (weight_scale_inv, 128x128 "
                             "blocks), fp8-channel = compressed-tensors (weight_scale per output channel)")
    parser.add_argument("--peaked-logits", action="store_true",
                        help="scale the lm_head's rows (3 x lognormal) so that the top logit leads by several "
                             "standard deviations: greedy outputs that rounding (bf16, batch shapes) does not flip")
    parser.add_argument("--copying", action="store_true",
                        help="layers 0 and 1 an induction circuit (llama, mistral): the model continues the spans "
                             "its context repeats, as prompt lookup needs, with clear argmaxes; the same cost")
    parser.add_argument("--no-weights", action="store_true",
                        help="config.json, the tokenizer and generation_config.json only: a model to serve or "
                             "benchmark with --load-format dummy (random weights made on the device)")
    draft = parser.add_argument_group("a speculative-decoding draft derived from a target (then --arch/--shape are unused)")
    draft.add_argument("--draft-of", default=None, help="target checkpoint directory to derive the draft from")
    draft.add_argument("--draft-layers", type=int, default=None, help="keep the target's first N layers (default: all)")
    draft.add_argument("--noise", type=float, default=0.0, help="relative Gaussian noise added to every weight")
    head = parser.add_argument_group("a random EAGLE head for a target (--speculative eagle | eagle3; then "
                                     "--arch/--shape are unused)")
    head.add_argument("--eagle-head-of", default=None, help="target checkpoint directory the head is for")
    head.add_argument("--eagle-method", choices=["eagle", "eagle3"], default="eagle3")
    head.add_argument("--draft-vocab-size", type=int, default=None,
                      help="eagle3: the head's lm_head over this many random ids (default: the whole vocabulary)")
    parser.set_defaults(func=run_make_model)
    return parser


def run_make_model(args: argparse.Namespace) -> int:
    from llmserve.testing.maker import make_model

    if args.draft_of is not None:
        from llmserve.testing.draft_maker import derive_draft

        path = derive_draft(args.draft_of, args.out, args.draft_layers, args.noise, args.seed)
        print(f"wrote a draft of {args.draft_of} to {path}")
        return 0
    if args.eagle_head_of is not None:
        from llmserve.testing.eagle_maker import make_eagle_head

        path = make_eagle_head(args.eagle_head_of, args.out, args.eagle_method, args.seed,
                               draft_vocab_size=args.draft_vocab_size)
        print(f"wrote a random {args.eagle_method} head for {args.eagle_head_of} to {path}")
        return 0
    path = make_model(args.arch, args.shape, args.out, seed=args.seed, dtype=args.dtype,
                      quantization=args.quantization, is_peaked=args.peaked_logits, is_copying=args.copying,
                      has_weights=not args.no_weights)
    fmt = f" ({args.quantization})" if args.quantization else ""
    fmt += ", peaked logits" if args.peaked_logits else ""
    fmt += ", copying" if args.copying else ""
    fmt += ", no weights (--load-format dummy)" if args.no_weights else ""
    print(f"wrote {args.arch} {args.shape}{fmt} checkpoint to {path}")
    return 0
