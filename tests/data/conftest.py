"""Shared fixtures for the data tests: a small mixed English/Chinese corpus and tokenizers."""
import itertools

import pytest

from naohai.data.corpus import fortunes_documents, pydoc_documents
from naohai.data.tokenizer import train_tokenizer


@pytest.fixture(scope="session")
def mixed_docs():
    english = list(itertools.islice(pydoc_documents(), 25))
    chinese = list(itertools.islice(fortunes_documents(), 400))
    return [d for pair in itertools.zip_longest(english, chinese[:25]) for d in pair if d] + chinese[25:]


@pytest.fixture(scope="session")
def tok(mixed_docs, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "plain"
    return train_tokenizer(mixed_docs, 1024, str(out))


@pytest.fixture(scope="session")
def tok_jieba(mixed_docs, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "jieba"
    return train_tokenizer(mixed_docs, 1024, str(out), jieba=True)
