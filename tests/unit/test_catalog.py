"""The model catalog: the shipped file parses and holds plausible figures; a broken file is
refused in one line naming the file and the entry; a newer one a user drops in wins."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import tomli_w

from engine.models import catalog as cat
from engine.models import embedded as model_embedded
from engine.models import ids as model_ids
from engine.models.catalog import CatalogError, load_catalog, parse_catalog

BUNDLED = Path(__file__).resolve().parents[2] / "resources" / "catalog.toml"


@pytest.fixture(scope="module")
def shipped() -> cat.Catalog:
    return parse_catalog(BUNDLED.read_text(encoding="utf-8"), source=str(BUNDLED))


# --- the shipped catalog --------------------------------------------------------------


def test_the_shipped_catalog_is_the_bundled_one_and_loads_without_a_line(
        tmp_path: Path) -> None:
    catalog, line = load_catalog(tmp_path)
    assert cat.bundled_catalog_path() == BUNDLED
    assert (line, catalog.source, catalog.version, catalog.updated) == (
        "", str(BUNDLED), 1, "2026-12-02")


def test_every_entry_has_its_fields_and_2_to_4_quants_with_q4_k_m(
        shipped: cat.Catalog) -> None:
    models = [e for e in shipped.entries if not e.embeddings]
    assert 15 <= len(models) <= 27
    assert 3 <= len(shipped.entries) - len(models) <= 6  # embeddings models
    for e in shipped.entries:
        assert e.name and e.license and e.gguf_repo and e.note, e.id
        assert e.params_b > 0 and e.context >= (512 if e.embeddings else 2048), e.id
        assert min(e.layers, e.embedding, e.kv_heads, e.head_dim) > 0, e.id
        assert e.uses and set(e.uses) <= set(cat.USES), e.id
        # an embeddings model's repository may hold one quantisation only
        assert (1 if e.embeddings else 2) <= len(e.quants) <= 4, e.id
        assert e.embeddings or "Q4_K_M" in {q.name for q in e.quants}, e.id
        assert e.quant().name == e.default_quant, e.id
        assert set(e.estimated) <= cat._ESTIMABLE, e.id
        for q in e.quants:
            assert q.files and all(f.endswith(".gguf") for f in q.files), (e.id, q.name)
            assert q.size > 0, (e.id, q.name)


def test_ids_and_repositories_are_unique_and_valid_hub_ids(shipped: cat.Catalog) -> None:
    ids = [e.id for e in shipped.entries]
    repos = [e.gguf_repo.lower() for e in shipped.entries]
    assert len(set(ids)) == len(ids)
    assert len(set(repos)) == len(repos)
    for e in shipped.entries:
        assert model_ids.parse_model_id(e.gguf_repo).quant is None
        if e.mlx_repo is not None:
            assert e.mlx_repo.startswith("mlx-community/"), e.id


def test_every_size_is_plausible_for_the_parameters_and_the_quant(
        shipped: cat.Catalog) -> None:
    checked = 0
    for e in shipped.entries:
        for q in e.quants:
            bits = q.bits_per_weight
            assert bits is not None, (e.id, q.name)  # every shipped quant has known bits
            ratio = q.size / (e.params_b * 1e9 * bits / 8)
            assert 0.6 <= ratio <= 1.7, (e.id, q.name, ratio)
            checked += 1
    assert checked >= 2 * len(shipped.entries)


def test_the_catalog_covers_autocomplete_agents_and_small_machines(
        shipped: cat.Catalog) -> None:
    assert any(e.fim and "autocomplete" in e.uses for e in shipped.entries)
    assert any(e.tools and "agents" in e.uses for e in shipped.entries)
    assert sum("small" in e.uses for e in shipped.entries) >= 4
    assert any(e.thinking for e in shipped.entries)


def test_the_two_test_models_are_small_entries_with_the_files_the_tests_serve(
        shipped: cat.Catalog) -> None:
    smol = shipped.get("smollm2-135m-instruct")
    gemma = shipped.get("gemma-3-270m-it")
    assert smol is not None and gemma is not None
    assert smol.uses == ("small",) and gemma.uses == ("small",)
    # the embedded default is this repository's Q4_1 file, byte for byte
    assert smol.quant().files == (model_embedded.EMBEDDED_FILE,)
    assert smol.quant().size == 98_362_432
    assert gemma.quant("Q4_K_M").files == ("gemma-3-270m-it-Q4_K_M.gguf",)


# --- lookups ----------------------------------------------------------------------------


def test_spec_and_by_spec_round_trip_for_every_quant(shipped: cat.Catalog) -> None:
    for e in shipped.entries:
        for q in e.quants:
            spec = e.spec(q.name)
            assert spec == f"{e.gguf_repo}:{q.name}"
            assert model_ids.parse_model_id(spec) == model_ids.ModelId(e.gguf_repo, q.name)
            assert shipped.by_spec(spec) == (e, q)
            assert shipped.by_spec(spec.upper()) == (e, q)
            assert shipped.by_spec(spec.lower()) == (e, q)
        assert shipped.by_spec(e.gguf_repo) == (e, e.quant())
        assert e.spec() == f"{e.gguf_repo}:{e.default_quant}"


@pytest.mark.parametrize("spec", [
    "unsloth/Qwen2.5-Coder-7B-Instruct-GGUF:IQ1_S",  # a repo it lists, a quant it does not
    "someone/Unknown-GGUF:Q4_K_M",
    "not a model id",
    "",
])
def test_by_spec_is_none_for_what_the_catalog_does_not_list(
        shipped: cat.Catalog, spec: str) -> None:
    assert shipped.by_spec(spec) is None


def test_get_takes_an_id_in_any_case_and_quant_refuses_an_unknown_name(
        shipped: cat.Catalog) -> None:
    e = shipped.get("Qwen2.5-Coder-7B-Instruct")
    assert e is not None and e.id == "qwen2.5-coder-7b-instruct"
    assert shipped.get("no-such-model") is None
    assert e.quant("q8_0").name == "Q8_0"
    with pytest.raises(CatalogError) as err:
        e.quant("IQ1_S")
    line = str(err.value)
    assert "\n" not in line
    assert line == ("qwen2.5-coder-7b-instruct: no quantisation 'IQ1_S'; "
                    "choose one of Q4_K_M, Q5_K_M, Q6_K, Q8_0")


def test_kv_bytes_per_token_of_qwen_coder_7b(shipped: cat.Catalog) -> None:
    e = shipped.get("qwen2.5-coder-7b-instruct")
    assert e is not None
    # 28 layers x (key + value) x 4 KV heads x 128 x 2 bytes
    assert e.kv_bytes_per_token() == 57_344
    assert e.kv_bytes_per_token("f16") == 28 * 2 * 4 * 128 * 2
    # q8_0 keeps a block of 32 elements in 34 bytes instead of 64
    assert e.kv_bytes_per_token("q8_0") == 28 * 2 * 4 * 128 * 34 // 32 == 30_464
    with pytest.raises(CatalogError, match=r"no KV cache type 'q4_0'; use one of f16, q8_0"):
        e.kv_bytes_per_token("q4_0")


@pytest.mark.parametrize(("name", "bits"), [
    ("Q4_K_M", 4.85), ("q4_k_m", 4.85), ("Q8_0", 8.5), ("Q6_K", 6.56), ("Q4_1", 5.0),
    ("Q2_K", 3.35), ("IQ4_XS", 4.25), ("BF16", 16.0), ("F16", 16.0), ("MXFP4", 4.25),
    ("Q5_K_S", 5.55), ("UD-Q4_K_XL", None), ("Q3_K_L", None),
])
def test_bits_per_weight_by_quant_name(name: str, bits: float | None) -> None:
    assert cat.CatalogQuant(name, ("m.gguf",), 1).bits_per_weight == bits


# --- refusals ----------------------------------------------------------------------------

GOOD: dict[str, Any] = {
    "version": 3, "updated": "2026-12-01",
    "model": [{
        "id": "tiny-coder", "name": "Tiny Coder", "params_b": 7.0,
        "uses": ["code", "autocomplete"], "tools": True, "fim": True, "thinking": False,
        "context": 32768, "license": "apache-2.0", "layers": 28, "embedding": 3584,
        "kv_heads": 4, "head_dim": 128, "gguf_repo": "org/Tiny-Coder-GGUF",
        "default_quant": "Q4_K_M", "estimated": [], "note": "a test entry",
        "quant": [
            {"name": "Q4_K_M", "files": ["Tiny-Coder-Q4_K_M.gguf"], "size": 4_300_000_000},
            {"name": "Q8_0", "files": ["Tiny-Coder-Q8_0-00001-of-00002.gguf",
                                       "Tiny-Coder-Q8_0-00002-of-00002.gguf"],
             "size": 7_500_000_000},
        ],
    }],
}


def _text(doc: dict[str, Any]) -> str:
    return tomli_w.dumps(doc)


def _with(change: Any) -> str:
    doc = copy.deepcopy(GOOD)
    change(doc)
    return _text(doc)


def _entry(doc: dict[str, Any]) -> dict[str, Any]:
    entry: dict[str, Any] = doc["model"][0]
    return entry


def test_a_good_file_parses_into_tuples_with_its_split_files() -> None:
    c = parse_catalog(_text(GOOD), source="x.toml")
    (e,) = c.entries
    assert (c.version, c.updated, c.source) == (3, "2026-12-01", "x.toml")
    assert e.uses == ("code", "autocomplete") and e.mlx_repo is None
    assert e.quant("Q8_0").files == ("Tiny-Coder-Q8_0-00001-of-00002.gguf",
                                     "Tiny-Coder-Q8_0-00002-of-00002.gguf")


REFUSED = [
    # a field missing
    (lambda d: _entry(d)["quant"][0].pop("size"),
     "entry 'tiny-coder': 'size' of quant Q4_K_M is missing; add size = <a positive integer>"),
    (lambda d: _entry(d).pop("layers"),
     "entry 'tiny-coder': 'layers' is missing; add layers = <a positive integer>"),
    (lambda d: _entry(d).pop("id"), "entry #1: 'id' is missing"),
    # a wrong type
    (lambda d: _entry(d).update(layers="28"),
     "entry 'tiny-coder': 'layers' is a string ('28'), not an integer; make it a positive"),
    (lambda d: _entry(d).update(tools="yes"),
     "entry 'tiny-coder': 'tools' is a string ('yes'), not a boolean; make it true or false"),
    (lambda d: _entry(d).update(params_b=True), "entry 'tiny-coder': 'params_b' is a boolean"),
    (lambda d: _entry(d)["quant"][1].update(files="Tiny-Coder-Q8_0.gguf"),
     "entry 'tiny-coder': 'files' of quant Q8_0 is a string"),
    (lambda d: _entry(d).update(kv_heads=0), "entry 'tiny-coder': 'kv_heads' is 0"),
    # an implausible size
    (lambda d: _entry(d)["quant"][0].update(size=430_000_000),
     "entry 'tiny-coder': size 430,000,000 of Q4_K_M is implausible for 7B parameters at "
     "4.85 bits a weight"),
    (lambda d: _entry(d).update(params_b=70.0), "of Q4_K_M is implausible for 70B parameters"),
    # the same id twice, a repository listed twice
    (lambda d: d["model"].append(copy.deepcopy(_entry(d))),
     "entry 'tiny-coder' is listed twice; give each entry its own id"),
    (lambda d: d["model"].append({**copy.deepcopy(_entry(d)), "id": "other"}),
     "entry 'other': gguf_repo org/Tiny-Coder-GGUF is also entry 'tiny-coder''s"),
    # a repository id the hub would not take
    (lambda d: _entry(d).update(gguf_repo="org/Tiny--Coder"),
     "entry 'tiny-coder': 'gguf_repo' 'org/Tiny--Coder' is not a hub repository id"),
    (lambda d: _entry(d).update(gguf_repo="org/Tiny-Coder-GGUF:Q4_K_M"),
     "'gguf_repo' 'org/Tiny-Coder-GGUF:Q4_K_M' is not a hub repository id"),
    (lambda d: _entry(d).update(mlx_repo="just-a-name"),
     "entry 'tiny-coder': 'mlx_repo' 'just-a-name' is not a hub repository id"),
    # the default quant not among the quants, a quant twice
    (lambda d: _entry(d).update(default_quant="Q5_K_M"),
     "entry 'tiny-coder': default_quant 'Q5_K_M' is not among its quants; set it to one of "
     "Q4_K_M, Q8_0"),
    (lambda d: _entry(d)["quant"][1].update(name="q4_k_m", size=4_300_000_000),
     "entry 'tiny-coder': quant Q4_K_M is listed twice; keep one [[model.quant]] per name"),
    # odd values
    (lambda d: _entry(d).update(context=512), "entry 'tiny-coder': 'context' is 512 tokens"),
    (lambda d: _entry(d).update(uses=["code", "gaming"]), "'uses' has 'gaming'"),
    (lambda d: _entry(d).update(id="Tiny Coder"), "id 'Tiny Coder' is not a short slug"),
    (lambda d: _entry(d)["quant"][0].update(files=["../evil.gguf"]),
     "file '../evil.gguf' of quant Q4_K_M is not a .gguf path inside the repository"),
    (lambda d: _entry(d).update(estimated=["speed"]), "'estimated' names 'speed', not a figure"),
    (lambda d: _entry(d).update(note="two\nlines"), "entry 'tiny-coder': 'note' is several"),
    # the top level
    (lambda d: d.update(version=0), "version 0 is not a positive integer"),
    (lambda d: d.update(version="2"), "version '2' is not a positive integer"),
    (lambda d: d.pop("version"), "version None is not a positive integer"),
    (lambda d: d.update(updated="yesterday"), "'updated' 'yesterday' is not a date"),
    (lambda d: d.update(model=[]), "has no [[model]] entries"),
]


@pytest.mark.parametrize(("change", "expected"), REFUSED)
def test_a_bad_file_is_refused_in_one_line_naming_the_file_and_the_entry(
        change: Any, expected: str) -> None:
    with pytest.raises(CatalogError) as err:
        parse_catalog(_with(change), source="/x/catalog.toml")
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("/x/catalog.toml: ")
    assert expected in line
    assert err.value.source == "/x/catalog.toml"
    assert line == f"/x/catalog.toml: {err.value.reason}; {err.value.fix}"


def test_text_that_is_not_toml_is_refused_in_one_line() -> None:
    with pytest.raises(CatalogError) as err:
        parse_catalog('version = 1\n[[model]\nid = "x"\n', source="c.toml")
    assert str(err.value).startswith("c.toml: is not TOML (")
    assert "\n" not in str(err.value)


# --- which file is used --------------------------------------------------------------------


def test_a_newer_catalog_in_home_replaces_the_bundled_one(tmp_path: Path) -> None:
    text = BUNDLED.read_text(encoding="utf-8").replace("version = 1\n", "version = 2\n", 1)
    text = text.replace('id = "gpt-oss-20b"', 'id = "gpt-oss-20b-mine"', 1)
    (tmp_path / "catalog.toml").write_text(text, encoding="utf-8")
    catalog, line = load_catalog(tmp_path)
    mine = str(tmp_path / "catalog.toml")
    assert (catalog.version, catalog.source) == (2, mine)
    assert catalog.get("gpt-oss-20b-mine") is not None and catalog.get("gpt-oss-20b") is None
    assert line == f"using {mine} (catalog v2, newer than the bundled v1)"


def test_an_older_or_equal_catalog_in_home_leaves_the_bundled_one(tmp_path: Path) -> None:
    (tmp_path / "catalog.toml").write_text(_text({**GOOD, "version": 1}), encoding="utf-8")
    catalog, line = load_catalog(tmp_path)
    assert catalog.source == str(BUNDLED) and catalog.get("tiny-coder") is None
    assert line.startswith(f"{tmp_path / 'catalog.toml'} is catalog v1, not newer than the "
                           "bundled v1; using the bundled catalog")


@pytest.mark.parametrize(("content", "reason"), [
    (_with(lambda d: _entry(d)["quant"][0].pop("size")),
     "entry 'tiny-coder': 'size' of quant Q4_K_M is missing"),
    (b"version = 9\n\xff\xfe", "is not UTF-8 text"),
    (_with(lambda d: d.update(version=-4)), "version -4 is not a positive integer"),
])
def test_a_broken_catalog_in_home_is_refused_and_the_bundled_one_used(
        tmp_path: Path, content: str | bytes, reason: str) -> None:
    path = tmp_path / "catalog.toml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    catalog, line = load_catalog(tmp_path)
    assert catalog.source == str(BUNDLED) and catalog.version == 1
    assert line == (f"{path} is refused ({reason}); using the bundled catalog v1; "
                    "fix or remove it")


def test_a_catalog_under_the_home_folder_is_shown_with_a_tilde(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    shoal = tmp_path / ".shoal"
    shoal.mkdir()
    (shoal / "catalog.toml").write_text('version = 5\nupdated = "2026-12-24"\n',
                                        encoding="utf-8")
    _, line = load_catalog(shoal)
    assert line == ("~/.shoal/catalog.toml is refused (has no [[model]] entries); using the "
                    "bundled catalog v1; fix or remove it")


def test_a_huge_file_is_refused_without_being_read_whole(tmp_path: Path) -> None:
    (tmp_path / "catalog.toml").write_bytes(b"#" * (cat.MAX_CATALOG_BYTES + 1))
    _, line = load_catalog(tmp_path)
    assert "is refused (is larger than 4 MiB)" in line


def test_a_broken_bundled_catalog_is_an_error_naming_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = tmp_path / "resources" / "catalog.toml"
    broken.parent.mkdir()
    broken.write_text("version = 1\nupdated = \"2026-01-01\"\n", encoding="utf-8")
    monkeypatch.setattr(cat, "bundled_catalog_path", lambda: broken)
    with pytest.raises(CatalogError, match=r"catalog\.toml: has no \[\[model\]\] entries"):
        load_catalog(tmp_path / "home")
    broken.unlink()
    with pytest.raises(CatalogError, match=r"catalog\.toml: cannot be read \("):
        load_catalog(tmp_path / "home")


def test_a_frozen_bundle_reads_the_catalog_from_its_resources(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    monkeypatch.setattr(sys, "_MEIPASS", str(tmp_path), raising=False)
    assert cat.bundled_catalog_path() == tmp_path / "resources" / "catalog.toml"


def test_a_deeply_nested_catalog_in_home_leaves_the_bundled_one_in_use(tmp_path) -> None:
    """tomllib recurses once per level: without the depth check the RecursionError
    escaped and Shoal did not start."""
    (tmp_path / cat.CATALOG_FILE).write_text("version = 99\nx = " + "[" * 5000 + "]" * 5000)
    used, line = cat.load_catalog(tmp_path)
    assert used.version < 99
    assert "nests too deep" in line and "fix or remove it" in line


# --- embeddings models -------------------------------------------------------------------

EMBEDDINGS: dict[str, Any] = {
    "id": "tiny-embed", "name": "Tiny Embed", "params_b": 0.137, "uses": ["embeddings"],
    "tools": False, "fim": False, "thinking": False, "context": 512, "license": "mit",
    "layers": 12, "embedding": 768, "kv_heads": 12, "head_dim": 64,
    "gguf_repo": "org/Tiny-Embed-GGUF", "default_quant": "Q8_0", "estimated": [],
    "dimensions": 768, "note": "",
    "quant": [{"name": "Q8_0", "files": ["tiny-embed.Q8_0.gguf"], "size": 146_146_432}],
}


def test_the_shipped_embeddings_models_say_their_dimensions(shipped: cat.Catalog) -> None:
    emb = {e.id: e for e in shipped.entries if e.embeddings}
    assert {"nomic-embed-text-v1.5", "qwen3-embedding-0.6b"} <= set(emb)
    assert emb["nomic-embed-text-v1.5"].gguf_repo == "nomic-ai/nomic-embed-text-v1.5-GGUF"
    assert emb["nomic-embed-text-v1.5"].dimensions == 768
    assert emb["qwen3-embedding-0.6b"].dimensions == 1024
    for e in emb.values():
        assert e.uses == ("embeddings",) and not (e.tools or e.fim or e.thinking), e.id
        assert 0 < e.dimensions <= cat.MAX_DIMENSIONS, e.id
    assert all(e.dimensions == 0 for e in shipped.entries if not e.embeddings)


def test_an_embeddings_model_parses_with_a_bert_window_and_its_dimensions() -> None:
    doc = {**copy.deepcopy(GOOD), "model": [copy.deepcopy(EMBEDDINGS)]}
    (e,) = parse_catalog(_text(doc), source="x.toml").entries
    assert (e.embeddings, e.dimensions, e.context, e.active_b) == (True, 768, 512, None)


def _embeddings_with(change: Any) -> str:
    doc = {**copy.deepcopy(GOOD), "model": [copy.deepcopy(EMBEDDINGS)]}
    change(_entry(doc))
    return _text(doc)


@pytest.mark.parametrize(("text", "expected"), [
    (_embeddings_with(lambda e: e.pop("dimensions")),
     "entry 'tiny-embed': 'dimensions' is missing; add dimensions = <a positive integer>"),
    (_embeddings_with(lambda e: e.update(dimensions=100_000)),
     "entry 'tiny-embed': 'dimensions' is 100000; give the vector length, at most 16384"),
    (_embeddings_with(lambda e: e.update(uses=["embeddings", "chat"])),
     "entry 'tiny-embed': 'uses' names embeddings with other uses"),
    (_embeddings_with(lambda e: e.update(context=256)),
     "entry 'tiny-embed': 'context' is 256 tokens; give the trained window, at least 512"),
    (_with(lambda d: _entry(d).update(dimensions=768)),
     "entry 'tiny-coder': 'dimensions' is set on a model that is not for embeddings"),
    (_with(lambda d: _entry(d).update(context=512)),
     "entry 'tiny-coder': 'context' is 512 tokens; give the trained window, at least 2048"),
    (_with(lambda d: _entry(d).update(active_b=9.0)), "entry 'tiny-coder': 'active_b' is 9.0"),
])
def test_embeddings_and_expert_figures_are_checked(text: str, expected: str) -> None:
    with pytest.raises(CatalogError) as got:
        parse_catalog(text, source="x.toml")
    assert str(got.value).startswith(f"x.toml: {expected}")


def test_a_mixture_of_experts_is_estimated_at_its_active_share(shipped: cat.Catalog) -> None:
    from engine.models.choice import shape_of

    e = shipped.get("qwen3-30b-a3b-instruct-2507")
    assert e is not None and e.active_b == 3.3
    shape = shape_of(e, e.quant())
    assert shape.active_size == int(e.quant().size * 3.3 / 30.5)


def test_the_fit_of_an_embeddings_entry_has_no_decode_speed(shipped: cat.Catalog) -> None:
    from engine.models.choice import fits_for
    from engine.models.fit import Machine

    desk = Machine("desk", ram_total=16 << 30, mem_bandwidth=20_000_000_000)
    fits = {f.entry.id: f for f in fits_for(shipped, desk)}
    assert fits["nomic-embed-text-v1.5"].best.fit.fits
    assert fits["nomic-embed-text-v1.5"].best.fit.tps is None
    assert fits["qwen2.5-coder-7b-instruct"].best.fit.tps is not None
