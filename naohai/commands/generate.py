"""`naohai generate CHECKPOINT --prompt TEXT [--prompt TEXT ...] [--chat [--system TEXT]]`: sample text from a model;
with ``--chat`` each prompt is a user turn of a conversation, rendered as supervised fine-tuning rendered them.
``--chat`` without ``--prompt`` holds a conversation of many turns: each line read from standard input is the next
user turn, asked with the turns before it and the model's answers to them."""
from __future__ import annotations

import sys


def register(sub) -> None:
    p = sub.add_parser("generate", help="sample text from a checkpoint (greedy / temperature / top-k / top-p)")
    p.add_argument("checkpoint", help="a run folder (its latest checkpoint), a checkpoint folder, or an "
                                      "imported model folder")
    p.add_argument("--prompt", action="append", default=None, help="text to continue (repeat for a batch)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default: the model folder's generation_config.json, as transformers reads it, "
                        "else 0.8)")
    p.add_argument("--top-k", type=int, default=None, help="0 = off (default: generation_config.json, else 40)")
    p.add_argument("--top-p", type=float, default=None, help="1 = off (default: generation_config.json, else 0.95)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="PanGu-alpha used 1.5")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="PanGu-alpha used 0.3")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="transformers' repetition_penalty: a logit of an id already in the prompt or the answer is "
                        "divided by it (multiplied when negative); 1 = off (default: generation_config.json's, "
                        "else 1)")
    p.add_argument("--chat", action="store_true",
                   help="for a fine-tuned (SFT) model: each --prompt is a user turn, rendered as the SFT data was "
                        "(the tokenizer's chat template, else naohai's 'User: ...' / 'Assistant: '); prints the answer "
                        "alone, which ends at the EOD the model learned; without --prompt, a conversation: each "
                        "line of standard input is the next user turn, asked with the turns and answers before it "
                        "(/reset starts over; end of input ends)")
    p.add_argument("--system", default=None, help="with --chat: a system turn before each prompt")
    p.add_argument("--stream", action="store_true", help="print tokens as they come (one prompt)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "CPU", "GPU", "Ascend"), default="auto",
                   help="device (default auto = Ascend, else GPU, else CPU)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the SHA-256 check of the checkpoint's files (sizes are still checked)")
    p.set_defaults(run=run)


def run(args) -> int:
    from naohai.errors import UserError
    from naohai.generate import NAOHAI_SAMPLING, Generator, SamplingConfig, sampling_defaults

    conversation = args.chat and args.prompt is None
    prompts = args.prompt or ([] if conversation else [""])
    for i, prompt in enumerate(prompts):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:       # bytes the locale could not decode arrive as surrogates
            bad = prompt[exc.start].encode("utf-8", "surrogateescape")
            raise UserError(f"prompt {i + 1} is not valid UTF-8 text (byte 0x{bad.hex()} at character "
                            f"{exc.start}); pass UTF-8 text", where="command line", key="--prompt") from None
    if args.system is not None and not args.chat:
        raise UserError("--system is a turn of a chat; add --chat (or drop --system)", where="command line",
                        key="--system", rule="--system with --chat")
    if args.chat and not all(p.strip() for p in prompts):
        raise UserError("with --chat every --prompt is a user turn and must hold text", where="command line",
                        key="--prompt")
    if args.stream and len(prompts) > 1:
        raise UserError("--stream prints one prompt's tokens; give one --prompt", where="command line",
                        key="--stream")
    given = {key: getattr(args, key) for key in NAOHAI_SAMPLING if getattr(args, key) is not None}

    def sampling(defaults):
        return SamplingConfig(args.max_new_tokens, seed=args.seed, frequency_penalty=args.frequency_penalty,
                              presence_penalty=args.presence_penalty, **{**defaults, **given})
    sampling(NAOHAI_SAMPLING).validate()         # the flags' mistakes before the model is read
    gen = Generator(args.checkpoint, device=args.device, verify=not args.no_verify)
    defaults, note = sampling_defaults(gen.tokenizer)
    cfg = sampling(defaults)
    if note and len(given) < len(NAOHAI_SAMPLING):
        print(f"naohai: note: {note} (flags override)", file=sys.stderr)
    if conversation:
        return _conversation(gen, cfg, args.system, args.stream)
    chat = {"chat": args.chat, "system": args.system}
    if gen.conversational and not args.chat:
        print("naohai: note: this model was fine-tuned on conversations (data.format: sft); --chat asks it as "
              "its training data did", file=sys.stderr)
    for note in gen.window_notes(prompts, cfg.max_new_tokens, **chat):
        print(f"naohai: note: {note}", file=sys.stderr)
    if args.stream:
        sys.stdout.write("" if args.chat else prompts[0])
        gen.generate_batch(prompts, cfg, stream=lambda _row, text: (sys.stdout.write(text), sys.stdout.flush()),
                           **chat)
        sys.stdout.write("\n")
        return 0
    texts = gen.generate_batch(prompts, cfg, **chat)
    for i, (prompt, text) in enumerate(zip(prompts, texts), 1):
        if len(prompts) > 1:     # one header per prompt: continuations may hold blank lines of their own
            print(f"{'' if i == 1 else chr(10)}=== prompt {i} of {len(prompts)}: {prompt!r} ===")
        print(text.rstrip("\n") if args.chat else prompt + text)
    return 0


def _conversation(gen, cfg, system, stream: bool) -> int:
    """Turns from standard input (a line each; blank lines skipped, ``/reset`` starts over, the end of the input
    ends), each answer printed alone on standard output (:meth:`naohai.generate.Generator.reply`) and kept in the
    conversation as printed: the model's text without the line breaks it ended with, which the template writes.
    (naohai's template ends every turn with one, so the answer "Repeated: class" + newline it learned goes back
    as the same tokens.)"""
    from naohai.errors import UserError

    tty = sys.stdin.isatty()
    if tty:
        print("naohai: chat: a line is a message; /reset starts over, Ctrl-D ends", file=sys.stderr)
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    number = 0
    while True:
        if tty:
            sys.stderr.write("> ")
            sys.stderr.flush()
        raw = sys.stdin.buffer.readline()
        if not raw:
            return 0
        number += 1
        try:
            text = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as exc:
            raise UserError(f"line {number} is not valid UTF-8 text (byte 0x{raw[exc.start:exc.start + 1].hex()} "
                            f"at byte {exc.start}); the answers so far are above", where="standard input",
                            key="--chat") from None
        if text.strip() == "/reset":
            messages = list(start)
            print("naohai: chat: started over", file=sys.stderr)
            continue
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        write = (lambda piece: (sys.stdout.write(piece), sys.stdout.flush())) if stream else None
        answer = gen.reply(messages, cfg, stream=write, note=lambda text: print(f"naohai: note: {text}",
                                                                              file=sys.stderr, flush=True))
        if stream:
            print("" if answer.endswith("\n") else "\n", end="", flush=True)
        answer = answer.rstrip("\n")        # the template writes the turn's own line break (naohai's does)
        if not stream:
            print(answer, flush=True)
        messages.append({"role": "assistant", "content": answer})
