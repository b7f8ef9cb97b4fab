"""distmm.executor.driver: entry points typed through ctypes, checked on the C library standing
in for libcuda (no driver on CPU machines)."""
from __future__ import annotations

import ctypes
import ctypes.util

import pytest

from distmm.executor import driver


@pytest.fixture
def libc_as_driver(monkeypatch):
    monkeypatch.setattr(driver, "_LIB", [ctypes.CDLL(ctypes.util.find_library("c"))])


def test_entries_type_each_symbol_apart(libc_as_driver):
    ns = driver.entries({"len": ("strlen", [ctypes.c_char_p]), "abs": ("abs", [ctypes.c_int])})
    assert ns.len(b"four") == 4 and ns.abs(-7) == 7
    # a new function object per entry: another caller's typing leaves this one's alone
    other = driver.entry("strlen", [ctypes.c_void_p])
    assert other is not ns.len and tuple(ns.len.argtypes) == (ctypes.c_char_p,)


def test_a_missing_symbol_or_library_gives_none(libc_as_driver, monkeypatch):
    assert driver.entries({"x": ("distmm_no_such_symbol", []),
                           "len": ("strlen", [ctypes.c_char_p])}) is None
    monkeypatch.setattr(driver, "_LIB", [None])
    assert driver.entry("strlen", [ctypes.c_char_p]) is None
    assert driver.entries({"len": ("strlen", [ctypes.c_char_p])}) is None
