"""What the tests share and nothing tests itself: the servers and clients they run (serving,
hostile_http, sequence_models, kubeemu, localcluster, monitoring), Hypothesis profiles
(fuzzing), the docs' code blocks (snippets), and waiting on /metrics (metrics).

Imported as `support.<module>`: pytest puts tests/ on sys.path (`pythonpath` in
pyproject.toml's [tool.pytest.ini_options]); benchmarks/__init__.py does the same for them.
"""
