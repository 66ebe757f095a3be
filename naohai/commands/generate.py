"""`naohai generate CHECKPOINT --prompt TEXT [--prompt TEXT ...]`: sample text from a model."""
from __future__ import annotations

import sys


def register(sub) -> None:
    p = sub.add_parser("generate", help="sample text from a checkpoint (greedy / temperature / top-k / top-p)")
    p.add_argument("checkpoint", help="a run folder (its latest checkpoint), a checkpoint folder, or an "
                                      "imported model folder")
    p.add_argument("--prompt", action="append", default=None, help="text to continue (repeat for a batch)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=40, help="0 = off")
    p.add_argument("--top-p", type=float, default=0.95, help="1 = off")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="PanGu-alpha used 1.5")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="PanGu-alpha used 0.3")
    p.add_argument("--stream", action="store_true", help="print tokens as they come (one prompt)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "CPU", "GPU", "Ascend"), default="auto",
                   help="device (default auto = Ascend, else GPU, else CPU)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the SHA-256 check of the checkpoint's files (sizes are still checked)")
    p.set_defaults(run=run)


def run(args) -> int:
    from naohai.errors import UserError
    from naohai.generate import Generator, SamplingConfig

    prompts = args.prompt or [""]
    for i, prompt in enumerate(prompts):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:       # bytes the locale could not decode arrive as surrogates
            bad = prompt[exc.start].encode("utf-8", "surrogateescape")
            raise UserError(f"prompt {i + 1} is not valid UTF-8 text (byte 0x{bad.hex()} at character "
                            f"{exc.start}); pass UTF-8 text", where="command line", key="--prompt") from None
    if args.stream and len(prompts) > 1:
        raise UserError("--stream prints one prompt's tokens; give one --prompt", where="command line",
                        key="--stream")
    cfg = SamplingConfig(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed,
                         args.frequency_penalty, args.presence_penalty)
    cfg.validate()
    gen = Generator(args.checkpoint, device=args.device, verify=not args.no_verify)
    for note in gen.window_notes(prompts, cfg.max_new_tokens):
        print(f"naohai: note: {note}", file=sys.stderr)
    if args.stream:
        sys.stdout.write(prompts[0])
        gen.generate_batch(prompts, cfg, stream=lambda _row, text: (sys.stdout.write(text), sys.stdout.flush()))
        sys.stdout.write("\n")
        return 0
    texts = gen.generate_batch(prompts, cfg)
    for i, (prompt, text) in enumerate(zip(prompts, texts), 1):
        if len(prompts) > 1:     # one header per prompt: continuations may hold blank lines of their own
            print(f"{'' if i == 1 else chr(10)}=== prompt {i} of {len(prompts)}: {prompt!r} ===")
        print(prompt + text)
    return 0
