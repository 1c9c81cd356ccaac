"""Saving a Program to one file and loading it back without the Python code that made it.

The file is a safetensors file (no pickle): the program's constants (weights, stored in their own
dtypes, so int8 stays int8 and packed int4 stays packed) are its tensors, and its header metadata
holds a manifest; the program itself, serialized StableHLO from ``jax.export`` with the constants as
explicit parameters, is one more (zlib-compressed, uint8) tensor. A SHA-256 over everything guards against corrupted files, and a
format version against files from another jaxq. Saving writes a temporary file and renames it over
the target, so an existing file is never left half-written.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import stat
import tempfile
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxq import _compat as C
from jaxq._program import Program, _dtype_of, leaf_dtype, short_type
from jaxq._walk import map_equations

FORMAT = "jaxq.program"
FORMAT_VERSION = 2  # 2: the exported program is a zlib-compressed uint8 tensor
_PROGRAM = "jaxq.program"


class LoadError(Exception):
    """A saved program could not be loaded (wrong format or version, or a corrupted file)."""


def _safetensors() -> Any:
    try:
        import safetensors.numpy as st
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "saving and loading jaxq programs needs safetensors and flatbuffers: "
            "pip install 'jaxq[export]'"
        ) from e
    return st


def _as_storable(x: Any) -> tuple[np.ndarray, str]:
    """numpy array safetensors can store, plus the dtype to restore (e.g. bfloat16 as uint16)."""
    arr = np.asarray(x)
    name = arr.dtype.name
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2", "int4", "uint4"):
        arr = arr.view(np.dtype(f"uint{8 * arr.dtype.itemsize}"))
    return np.ascontiguousarray(arr).reshape(arr.shape), name  # (0-d stays 0-d)


def _digest(exported: bytes, tensors: dict[str, np.ndarray], manifest: dict[str, Any]) -> str:
    h = hashlib.sha256(exported)
    h.update(json.dumps(manifest, sort_keys=True).encode())
    for key in sorted(tensors):
        h.update(key.encode())
        h.update(tensors[key].tobytes())
    return h.hexdigest()


def is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def save(
    program: Program,
    path: str | os.PathLike[str],
    names: Mapping[int, str] | None = None,
    fixed: str | None = None,
) -> Path:
    """Write ``program`` to ``path`` (a single ``.jaxq`` safetensors file), atomically.
    ``names``: tensor names for some constants, by index (e.g. the param paths of quantized
    weights, ``Dense_0/kernel.codes``); the others are ``const_00000``... ``fixed``: why the
    program's shapes are fixed, for the loaded program's shape error (a program traced with
    symbolic dimensions keeps them: it then takes any size there)."""
    from jaxq import __version__

    st = _safetensors()
    path = Path(path)
    program = map_equations(program, lambda eqn, *_: [C.without_traceback(eqn)])
    closed = program.jaxpr
    # typed PRNG keys (a Flax NNX model's Rngs state) are stored as their key data
    key_impls = {i: jax.random.key_impl(c) for i, c in enumerate(closed.consts) if is_key(c)}
    consts = [jax.random.key_data(c) if i in key_impls else c for i, c in enumerate(closed.consts)]
    for i, c in enumerate(consts):
        if not hasattr(np.asarray(c), "dtype") or np.asarray(c).dtype == object:
            raise TypeError(f"save: constant {i} is a {type(c).__name__}, which cannot be stored")

    def with_consts(const_vals: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        flat = program.flatten_args(args, kwargs)
        const_vals = [
            jax.random.wrap_key_data(c, impl=key_impls[i]) if i in key_impls else c
            for i, c in enumerate(const_vals)
        ]
        run = C.jaxpr_as_fun(C.ClosedJaxpr(closed.jaxpr, list(const_vals)))
        return jax.tree.unflatten(program.out_tree, run(*flat))

    const_specs = [jax.ShapeDtypeStruct(np.shape(c), np.asarray(c).dtype) for c in consts]
    args, kwargs = jax.tree.unflatten(
        program.in_tree, [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in closed.in_avals]
    )
    # A file written on a GPU also runs on a CPU (serving): realize's GPU route is exact there. Not
    # the other way round: a CPU-realized program's int8 dots gave wrong sums on XLA:GPU.
    platforms = tuple(dict.fromkeys((jax.export.default_export_platform(), "cpu")))
    with C.no_source_locations():  # same bytes for the same model, no local paths in the file
        try:
            exported = bytes(
                jax.export.export(jax.jit(with_consts), platforms=platforms)(
                    const_specs, args, kwargs
                ).serialize()
            )
        except NotImplementedError as e:
            if "callback" not in str(e):
                raise
            raise TypeError(
                f"save: {program.name!r} calls back into Python (jax.debug.print, "
                "jax.pure_callback / io_callback, a 'host' backend region, ONNX Runtime through "
                "a callback), which a saved file cannot hold; save a program without them (for "
                f"regions: before partitioning it, or with XLA backends) ({e})"
            ) from e
    tensors, dtypes, keys = {}, [], []
    for i, c in enumerate(consts):
        key = (names or {}).get(i) or f"const_{i:05d}"
        if key in tensors or key == _PROGRAM:
            key = f"const_{i:05d}"
        tensors[key], dtype = _as_storable(c)
        dtypes.append(dtype)
        keys.append(key)
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "jaxq_version": __version__,
        "jax_version": jax.__version__,
        "name": program.name,
        "in_paths": list(program.in_paths),
        "const_dtypes": dtypes,
        "const_names": keys,
        "fixed": fixed,
    }
    digest = _digest(exported, tensors, manifest)
    tensors[_PROGRAM] = np.frombuffer(zlib.compress(exported, 9), np.uint8)
    metadata = {  # one key: safetensors writes several in no fixed order
        "jaxq.manifest": json.dumps({**manifest, "sha256": digest}),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        st.save_file(tensors, tmp, metadata=metadata)
        os.chmod(tmp, _file_mode(path))  # (mkstemp makes it 0600)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _file_mode(path: Path) -> int:
    """The permissions the saved file gets: an existing file's own, else the umask default."""
    if path.exists():
        return stat.S_IMODE(path.stat().st_mode)
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _fits(shape: tuple[int, ...], want: tuple[Any, ...]) -> bool:
    """Whether a concrete ``shape`` fits a saved one (symbolic dimensions fit any size)."""
    return len(shape) == len(want) and all(
        not isinstance(w, (int, np.integer)) or n == w for n, w in zip(shape, want, strict=True)
    )


def _fixed_axes(shape: tuple[int, ...], want: tuple[Any, ...]) -> str:
    """The fixed axes of a saved shape that ``shape`` misses, for an error: `` (axis 1 is fixed
    at 10)``; nothing where the ranks differ."""
    if len(shape) != len(want):
        return ""
    axes = [
        f"axis {i} is fixed at {w}"
        for i, (n, w) in enumerate(zip(shape, want, strict=True))
        if isinstance(w, (int, np.integer)) and n != w
    ]
    return f" ({', '.join(axes)})"


class LoadedProgram:
    """A program loaded from disk: call it like the original function (jit-able, fixed shapes).

    ``loaded(x)`` holds the weights; under ``jax.jit`` they would be compiled in as constants
    (compile time growing with their bytes), so pass them as an argument there, as
    ``QuantizedFunction`` does: ``jax.jit(loaded.apply)(loaded.params, x)``.

    Attributes:
      name: the saved program's name.
    """

    def __init__(self, exported: Any, consts: list[Any], manifest: dict[str, Any]) -> None:
        self.exported, self.consts, self.manifest = exported, consts, manifest
        self.name: str = manifest["name"]

    @property
    def params(self) -> dict[str, Any]:
        """The saved weights (and other constants), by tensor name (``Dense_0/kernel.codes``)."""
        names = self.manifest.get("const_names") or [
            f"const_{i:05d}" for i in range(len(self.consts))
        ]
        return dict(zip(names, self.consts, strict=True))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.apply(self.params, *args, **kwargs)

    def apply(self, params: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        """Run the program on ``params`` (shaped like :attr:`params`) and the arguments."""
        names = list(self.params)
        if not isinstance(params, Mapping) or sorted(params) != sorted(names):
            raise TypeError(
                f"{self.name}: apply takes the loaded program's params (a dict of "
                f"{len(names)} tensors by name: loaded.params) first; got "
                f"{type(params).__name__}"
            )
        consts = [params[n] for n in names]
        (_, want_args, want_kwargs), _ = jax.tree.unflatten(
            self.exported.in_tree, list(self.exported.in_avals)
        )
        flat, tree = jax.tree.flatten((args, kwargs))
        want, want_tree = jax.tree.flatten((tuple(want_args), want_kwargs))
        if str(tree) != str(want_tree):
            raise TypeError(
                f"{self.name}: called with arguments of another structure than it was saved with "
                f"({want_tree})"
            )
        bad = [
            f"  {p}: saved for {w.str_short()}, got {short_type(jnp.result_type(x), np.shape(x))}"
            + _fixed_axes(tuple(np.shape(x)), tuple(w.shape))
            for p, x, w in zip(self.manifest["in_paths"], flat, want, strict=True)
            if not _fits(tuple(np.shape(x)), tuple(w.shape))
        ]
        wrong = [
            f"  {p}: saved for {w.str_short()}, got {short_type(_dtype_of(x), np.shape(x))}"
            for p, x, w in zip(self.manifest["in_paths"], flat, want, strict=True)
            if leaf_dtype(x) != w.dtype
        ]
        if wrong and not bad:
            raise TypeError(
                f"{self.name}: called with arguments of other dtypes than it was saved with:\n"
                + "\n".join(wrong)
                + "\nCast them (x.astype(...)), or save the model again for these dtypes."
            )
        empty = [
            f"  {p}: saved for {w.str_short()}, got {short_type(None, np.shape(x))}"
            for p, x, w in zip(self.manifest["in_paths"], flat, want, strict=True)
            if not bad
            and any(
                n == 0 and not isinstance(d, (int, np.integer))
                for n, d in zip(np.shape(x), w.shape, strict=True)
            )
        ]
        if empty:
            raise ValueError(
                f"{self.name}: a saved program's symbolic dimensions take sizes of 1 or more "
                "(jax.export's rule), and got 0:\n" + "\n".join(empty) + "\nSkip the call "
                "for an empty batch."
            )
        if bad:
            why = self.manifest.get("fixed")
            raise TypeError(
                f"{self.name}: a saved program runs at the shapes it was saved at"
                + (f" ({why})" if why else "")
                + ":\n"
                + "\n".join(bad)
                + "\nSave the model again at the shape you need (qf.save(path, x) for a "
                "QuantizedFunction, jaxq.trace(f, x).save(path) for a Program), or pad the "
                "fixed axes to their saved sizes."
            )
        if kwargs:
            return self.exported.call(consts, args, kwargs)
        return self._call(consts, *args)

    @functools.cached_property
    def _call(self) -> Callable[..., Any]:
        """The exported call, with a vmap rule: one call per example, in a loop (an exported
        program has no batching rule of its own)."""
        return jax.custom_batching.sequential_vmap(
            lambda consts, *args: self.exported.call(consts, args, {})
        )

    def as_fun(self) -> Callable[..., Any]:
        """The program as a function (what calling it does), for symmetry with ``Program``."""
        return self.__call__

    @property
    def param_bytes(self) -> int:
        """Bytes of the saved constants (weights)."""
        return sum(int(np.asarray(c).nbytes) for c in self.consts)

    def __repr__(self) -> str:
        return (
            f"<jaxq.LoadedProgram {self.name!r}: {len(self.consts)} constants, "
            f"{self.param_bytes:,} bytes, saved by jaxq {self.manifest['jaxq_version']}>"
        )


def load(path: str | os.PathLike[str]) -> LoadedProgram:
    """Load a program written by :func:`save`; needs neither the model code nor jaxq's passes."""
    st = _safetensors()
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"jaxq.load: no file at {path}")
    try:
        with safe_open(str(path), framework="numpy") as fh:
            metadata = fh.metadata() or {}
        tensors = st.load_file(str(path))
    except Exception as e:
        raise LoadError(
            f"jaxq.load: {path} is not a readable safetensors file ({e}); it may be "
            "truncated or corrupted"
        ) from e
    if "jaxq.manifest" not in metadata:
        raise LoadError(f"jaxq.load: {path} is a safetensors file but not a saved jaxq program")
    try:
        manifest = json.loads(metadata["jaxq.manifest"])
        digest = manifest.pop("sha256", metadata.get("jaxq.sha256"))
    except Exception as e:
        raise LoadError(f"jaxq.load: the header of {path} is corrupted ({e})") from e
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise LoadError(
            f"jaxq.load: {path} has format {manifest.get('format')!r} version "
            f"{manifest.get('format_version')!r} (written by jaxq {manifest.get('jaxq_version')}); "
            f"this jaxq reads {FORMAT!r} version {FORMAT_VERSION}. Re-save the model with this "
            "jaxq version."
        )
    try:
        exported_bytes = zlib.decompress(tensors.pop(_PROGRAM).tobytes())
    except Exception as e:
        raise LoadError(f"jaxq.load: the program stored in {path} is corrupted ({e})") from e
    if _digest(exported_bytes, tensors, manifest) != digest:
        raise LoadError(f"jaxq.load: {path} is corrupted: its checksum does not match its contents")
    consts = []
    keys = manifest.get("const_names") or [f"const_{i:05d}" for i in range(len(tensors))]
    for key, dtype in zip(keys, manifest["const_dtypes"], strict=True):
        arr = tensors[key]
        consts.append(arr.view(jax.numpy.dtype(dtype)) if arr.dtype.name != dtype else arr)
    exported = jax.export.deserialize(bytearray(exported_bytes))
    try:  # (the module is read lazily: one this jax cannot read failed at the first call)
        exported.mlir_module()
    except Exception as e:
        saved = manifest.get("jax_version", "unknown")
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise LoadError(
            f"jaxq.load: this jax ({jax.__version__}) cannot read the program in {path}, which "
            f"jax {saved} wrote ({why}). Load it with jax {saved} or newer, or re-save the model "
            "with this jax."
        ) from e
    return LoadedProgram(exported, consts, manifest)
