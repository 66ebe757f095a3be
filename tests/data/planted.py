"""A small real corpus with planted defects, and the ground truth of what was planted.

English: the pydoc topics CPython ships.  Chinese: Debian's fortunes-zh, the
entries of 300 characters or more (joining short entries would repeat their
attribution lines and trip the repetition rules).  Other languages: the German, French, Russian and
Japanese messages of coreutils' gettext catalogs (Debian ships them), 40 messages per
document.  Planted: exact duplicates (case / spacing / punctuation changed),
near-duplicates (about 2% of the characters substituted), garbage documents, and
personal data of every kind the de-identification step knows, with valid check
digits computed here from the standards (GB 11643-1999, Luhn) plus decoys that must
stay.
"""
from __future__ import annotations

import gettext
import itertools
import random
import string
from dataclasses import dataclass, field
from typing import Dict, List

from naohai.data.corpus import fortunes_documents, pydoc_documents

ID_WEIGHTS = [7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2]


def id_number(rng: random.Random) -> str:
    area = rng.choice(["110105", "310104", "440305", "510107"])
    birth = f"{rng.randint(1950, 2005)}{rng.randint(1, 12):02d}{rng.randint(1, 28):02d}"
    body = area + birth + f"{rng.randint(0, 999):03d}"
    return body + "10X98765432"[sum(int(d) * w for d, w in zip(body, ID_WEIGHTS)) % 11]


def luhn_complete(prefix: str) -> str:
    digits = [int(d) for d in prefix]
    for check in range(10):
        total = 0
        for i, d in enumerate(reversed(digits + [check])):
            if i % 2 == 1:
                d *= 2
                d = d - 9 if d > 9 else d
            total += d
        if total % 10 == 0:
            return prefix + str(check)
    raise AssertionError


def bank_card(rng: random.Random) -> str:
    prefix = rng.choice(["622588", "621700", "411111", "510510"]) + "".join(rng.choice(string.digits)
                                                                        for _ in range(9))
    card = luhn_complete(prefix)
    return " ".join(card[i:i + 4] for i in range(0, 16, 4)) if rng.random() < 0.5 else card


def pii_items(rng: random.Random) -> Dict[str, List[str]]:
    return {
        "email": [f"{rng.choice(['zhang.san', 'li_si', 'wang5', 'j.doe'])}{rng.randint(1, 99)}@"
                  f"{rng.choice(['example.com', 'mail.example.cn', 'qq.com', 'uni-heidelberg.de'])}"],
        "phone": [rng.choice(["1", "+86 1"]) + f"{rng.choice('3456789')}{rng.randint(0, 9)}"
                  + f"{rng.randint(1000, 9999)}{rng.randint(1000, 9999)}",
                  f"0{rng.choice(['10', '21', '755'])}-{rng.randint(2, 8)}{rng.randint(1000000, 9999999)}",
                  rng.choice(["+1 415 555 2671", "+44 20 7946 0958", "+49 30 901820", "+81 3-1234-5678"])],
        "id_number": [id_number(rng)],
        "ip": [f"{rng.randint(1, 223)}.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}",
               rng.choice(["2001:db8::8a2e:370:7334", "fe80::1ff:fe23:4567:890a"])],
        "bank_card": [bank_card(rng)],
    }


DECOYS = ["版本 3.11.7 发布", "第 2024 年 12 月 31 日", "ID 110105194912310021 (bad check digit)",
          "order 4111 1111 1111 1112", "999.12.1.1", "ratio 1:2:3", "ISBN 978-7-111-12345-6",
          "std::vector<int>", "x = 12345678", "时间 12:30:45"]


def decoy_text(rng: random.Random) -> str:
    return " ".join(rng.sample(DECOYS, 3))


def edit_chars(text: str, fraction: float, rng: random.Random) -> str:
    chars = list(text)
    positions = [i for i, c in enumerate(chars) if c.isalnum()]
    for i in rng.sample(positions, max(1, int(len(positions) * fraction))):
        chars[i] = rng.choice("的一是在不了有和人这中大为上个国我以要他" if "\u4e00" <= chars[i] <= "\u9fff"
                              else string.ascii_lowercase)
    return "".join(chars)


def garbage(rng: random.Random, kind: int) -> str:
    if kind == 0:      # symbol / digit soup
        return "".join(rng.choice(string.digits + "#$%&*|~^") for _ in range(800))
    if kind == 1:      # the same advert line over and over
        return "\n".join(["限时抢购！点击链接领取优惠券 www.example.com 立即购买"] * 40)
    if kind == 2:      # bullet-only navigation menu
        return "\n".join(f"• {w}" for w in rng.choices(["Home", "About", "Login", "Cart", "Help"], k=120))
    if kind == 3:      # repeated n-gram spam
        return " ".join(["buy cheap watches now"] * 80)
    return "".join(chr(rng.randint(0xE000, 0xF8FF)) for _ in range(300)) + " lorem"   # private-use junk


def foreign_docs(per_doc: int = 40) -> Dict[str, List[str]]:
    out = {}
    for lang in ("de", "fr", "ru", "ja"):
        cat = gettext.translation("coreutils", "/usr/share/locale", [lang])._catalog
        msgs = [v for k, v in sorted(cat.items(), key=lambda kv: str(kv[0])) if isinstance(v, str) and len(v) > 40]
        out[lang] = [" ".join(m.strip() for m in msgs[i:i + per_doc]) for i in range(0, 8 * per_doc, per_doc)]
    return out


@dataclass
class Planted:
    docs: List[str] = field(default_factory=list)
    kind: List[str] = field(default_factory=list)      # base-en base-zh exact near garbage foreign pii
    origin: List[int] = field(default_factory=list)    # for exact/near: index of the original
    pii: Dict[int, Dict[str, List[str]]] = field(default_factory=dict)

    def add(self, text: str, kind: str, origin: int = -1) -> int:
        self.docs.append(text)
        self.kind.append(kind)
        self.origin.append(origin)
        return len(self.docs) - 1


def build(seed: int = 0, n_en: int = 60, n_zh: int = 60) -> Planted:
    rng = random.Random(seed)
    p = Planted()
    english = [d for d in pydoc_documents() if len(d) > 400][:n_en]
    chinese = list(itertools.islice((e.strip() for e in fortunes_documents() if len(e.strip()) >= 300), n_zh))
    base = [p.add(d, "base-en") for d in english] + [p.add(d, "base-zh") for d in chinese]
    for i in rng.sample(base, 20):
        src = p.docs[i]
        variant = src.upper() if rng.random() < 0.5 and src.isascii() else src.replace("\n", "\n\n").replace(
            "，", ",") + " 。"
        p.add(variant, "exact", i)
    for i in rng.sample(base, 20):
        p.add(edit_chars(p.docs[i], 0.02, rng), "near", i)
    for k in range(15):
        p.add(garbage(rng, k % 5), "garbage")
    for lang, docs in foreign_docs().items():
        for d in docs[:5]:
            p.add(d, f"foreign-{lang}")
    for i in rng.sample(base, 30):
        items = pii_items(rng)
        lines = p.docs[i].split("\n")
        for kind, values in items.items():
            for v in values:
                at = rng.randrange(len(lines) + 1)
                lines.insert(at, rng.choice(["联系方式：{} 。", "地址:{}", "Contact: {} today.", "{}"]).format(v))
        lines.insert(rng.randrange(len(lines) + 1), decoy_text(rng))
        j = p.add("\n".join(lines), "pii", i)
        p.pii[j] = items
    return p
