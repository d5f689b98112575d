"""The engine cache: immutable, verified entries on a shared volume.

Layout: `<root>/<namespace>/<model>/<key>/` holds the engine file (named by the backend's
`engine_filename`) and `manifest.json`. Builders publish into a temporary sibling
(`.tmp-<key>-*`, locked by its writer for as long as it lives) and rename it into place,
so a reader sees a complete entry or none, and two builders of one key end with one valid
entry. Runtime pods read the engine in one streaming pass that hashes as it reads and
refuse it when its size or a digest differs from the manifest: the manifest records the
whole file's sha256 (what `sha256sum` prints) and the sha256 of each `chunkBytes` piece,
which several threads read and check at once (see verify.read_verified).

An entry is trusted only for what lies inside its own directory: its manifest must name
its directory's key and a plain engine file name, and both files must be regular files
opened without following a symbolic link (docs/architecture.md, "The engine cache").
A corrupt entry is moved aside (`.quarantine-<key>-*`) by the next build of its key.
Garbage collection removes what the operator's plan names (it decides what no model needs),
orphans and debris; a build's cache hit touches its entry under a per-model-directory lock
(`.gc.lock`), so GC never removes an entry a build has just reported as a hit.

Its modules: `entry` (the manifest, an entry's paths, opening and checking an entry,
lookup), `publish` (publish, temporaries, quarantine), `verify` (reading an engine and
checking its digests), `gclock` (the GC lock, and use_entry: a build's cache-hit lookup),
`gc` (the executor of a GC plan: collect).
"""
