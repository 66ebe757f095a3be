"""Write naohai's built-in instruction set (builtin:sft-tasks, naohai/data/sft_tasks.py) from the pydoc corpus.

    python run/make_sft_tasks.py [--count 4000] [--words 200] [--seed 0]
"""
import argparse
import json

from naohai.data.sft_tasks import FILE, make_tasks, pydoc_words


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=4000)
    p.add_argument("--words", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rows = make_tasks(pydoc_words(args.words), args.count, args.seed)
    with open(FILE, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"wrote {len(rows)} instructions -> {FILE}")


if __name__ == "__main__":
    main()
