"""`naohai generate CHECKPOINT --prompt TEXT`: sample text from a trained model."""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("generate", help="sample text from a checkpoint (greedy / temperature / top-k / top-p)")
    p.add_argument("checkpoint", help="a run folder (uses its latest checkpoint) or a checkpoint folder")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=40, help="0 = off")
    p.add_argument("--top-p", type=float, default=0.95, help="1 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "CPU", "GPU", "Ascend"), default="auto",
                   help="device (default auto = Ascend, else GPU, else CPU)")
    p.set_defaults(run=run)


def run(args) -> int:
    from naohai.generate import Generator, SamplingConfig

    cfg = SamplingConfig(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)
    cfg.validate()
    gen = Generator(args.checkpoint, device=args.device)
    text = gen.generate(args.prompt, cfg)
    print(args.prompt + text)
    return 0
