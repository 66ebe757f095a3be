"""De-identification: personal data in a document replaced by placeholder tokens.

Kinds (each replaced by its own placeholder, in this order so a longer match wins):

``email``      ``local@domain.tld``
``id_number``  Chinese resident identity numbers (GB 11643-1999): 6-digit area code,
               a valid birth date (1900-2099), 3-digit order code and the ISO 7064
               MOD 11-2 check character; a wrong check digit is not an ID number.
``bank_card``  13-19 digits, optionally grouped by spaces or hyphens, that pass the
               Luhn check (ISO/IEC 7812).
``ip``         IPv4 dotted quads with octets 0-255, and IPv6 addresses (as the
               standard library's :mod:`ipaddress` accepts them) with two or more
               groups and a digit, so C++'s ``a::b`` is left alone.
``phone``      Chinese mobile numbers (``1[3-9]`` + 9 digits, optional ``+86``/``86``
               prefix and ``-``/space grouping 3-4-4), Chinese landlines (``0`` + 2-3
               digit area code + 7-8 digits, written with ``-``, a space or
               parentheses), and international numbers written with ``+`` and a
               country code (8-15 digits in all, E.164).

Digit runs are matched whole: a number inside a longer run of digits or letters is
left alone.
"""
from __future__ import annotations

import ipaddress
import re
from typing import Dict, Tuple

_ID_WEIGHTS = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)
_ID_CHECK = "10X98765432"

_B = r"(?<![0-9A-Za-z])"          # no digit/letter before
_E = r"(?![0-9A-Za-z])"           # none after
EMAIL = re.compile(r"(?<![\w.+-])[A-Za-z0-9][A-Za-z0-9._%+-]{0,63}@(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+"
                   r"[A-Za-z]{2,24}(?![\w-])")
ID_NUMBER = re.compile(_B + r"[1-9]\d{5}(?:19|20)\d{2}(?:0[1-9]|1[0-2])(?:0[1-9]|[12]\d|3[01])\d{3}[\dXx]" + _E)
BANK_CARD = re.compile(_B + r"\d{4}(?:[ -]?\d{4}){2}[ -]?\d{1,7}" + _E)
IPV4 = re.compile(_B + r"(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?![0-9A-Za-z]|\.\d)")
# after a non-hex character or after a colon that follows one ("地址:2001:db8::1", NFKC makes '：' ':')
IPV6 = re.compile(r"(?:(?<![0-9A-Za-z:])|(?<=[^0-9A-Fa-f:]:))(?=[0-9A-Fa-f]|::)(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?![0-9A-Za-z:])")
MOBILE_CN = re.compile(_B + r"(?:\+?86[ -]?)?1[3-9]\d(?:[ -]?\d{4}){2}" + _E)
LANDLINE_CN = re.compile(_B + r"(?:\(0\d{2,3}\)\s?|0\d{2,3}[- ])[2-9]\d{6,7}(?:-\d{1,5})?" + _E)
INTERNATIONAL = re.compile(r"(?<![\w+])\+[1-9]\d{0,2}(?:[ .-]?\(?\d{1,4}\)?)(?:[ .-]?\d{2,5}){1,5}" + _E)


def id_check_char(first17: str) -> str:
    """The ISO 7064 MOD 11-2 check character of the first 17 digits of an ID number."""
    return _ID_CHECK[sum(int(d) * w for d, w in zip(first17, _ID_WEIGHTS)) % 11]


def is_id_number(s: str) -> bool:
    return len(s) == 18 and s[:17].isdigit() and id_check_char(s[:17]) == s[17].upper()


def luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2 == 1:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _ipv6_ok(s: str) -> bool:
    groups = [g for g in s.split(":") if g]
    if len(groups) < 2 or not any(c.isdigit() for c in s):   # not '::1', 'a::b', 'std::vector'
        return False
    try:
        ipaddress.IPv6Address(s)
        return True
    except ValueError:
        return False


def _digits(s: str) -> str:
    return "".join(c for c in s if c.isdigit())


def _sub(pattern, text, placeholder, counts, kind, check=None):
    def repl(m):
        if check is not None and not check(m.group(0)):
            return m.group(0)
        counts[kind] = counts.get(kind, 0) + 1
        return placeholder
    return pattern.sub(repl, text)


def deidentify(text: str, cfg) -> Tuple[str, Dict[str, int]]:
    """(text with placeholders, {kind: replacements}) for a :class:`~naohai.data.clean_config.PIIConfig`."""
    counts: Dict[str, int] = {}
    if cfg.email and "@" in text:
        text = _sub(EMAIL, text, cfg.email, counts, "email")
    has_digits = any(c.isdigit() for c in text)
    if cfg.id_number and has_digits:
        text = _sub(ID_NUMBER, text, cfg.id_number, counts, "id_number", is_id_number)
    if cfg.bank_card and has_digits:
        text = _sub(BANK_CARD, text, cfg.bank_card, counts, "bank_card",
                    lambda s: 13 <= len(_digits(s)) <= 19 and luhn_ok(_digits(s)))
    if cfg.ip:
        if has_digits:
            text = _sub(IPV4, text, cfg.ip, counts, "ip")
        if "::" in text or text.count(":") >= 7:
            text = _sub(IPV6, text, cfg.ip, counts, "ip", _ipv6_ok)
    if cfg.phone and has_digits:
        text = _sub(MOBILE_CN, text, cfg.phone, counts, "phone")
        text = _sub(LANDLINE_CN, text, cfg.phone, counts, "phone")
        if "+" in text:
            text = _sub(INTERNATIONAL, text, cfg.phone, counts, "phone", lambda s: 8 <= len(_digits(s)) <= 15)
    return text, counts
