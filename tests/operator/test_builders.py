"""Pure builders: spec in, manifest out. One class per builder; golden checks of key fields."""

from __future__ import annotations

import json
import re

import pytest

from kiln.operator import manifests, observations
from kiln.operator.config import OperatorConfig
from kiln.operator.plan import plan_engines
from kiln.runtime.api import contract, enginekey
from kiln.runtime.api import spec as specmod

CONFIG = OperatorConfig(builder_image="registry.example/kiln:1", runtime_image="registry.example/kiln:1")
MODEL = {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceModel",
         "metadata": {"name": "resnet50", "namespace": "vision", "uid": "u-1", "generation": 3}}


def spec(**over) -> dict:
    s = {"model": {"uri": "pvc://models/resnet50/v1.7/resnet50.onnx", "version": "v1.7", "sha256": "3f" * 32},
         "engine": {"backend": "tensorrt", "precision": "fp16", "workspaceMiB": 4096,
                    "profiles": [{"input": "input", "min": [1, 3, 224, 224], "opt": [16, 3, 224, 224],
                                  "max": [32, 3, 224, 224]}]},
         "runtime": {"replicas": 2}}
    for k, v in over.items():
        s[k] = {**s.get(k, {}), **v}
    return specmod.apply_defaults(s)


class TestPlanEngines:
    def test_default_target_and_key_from_enginekey(self):
        [e] = plan_engines(spec(), CONFIG)
        s = spec()
        assert (e.target, e.architecture) == ("sm90", "sm90")
        assert e.key == enginekey.key_inputs(s["model"], s["engine"], "sm90", "10.13.0").key
        assert e.job_name == f"kiln-build-{e.key}-sm90" and len(e.job_name) <= 63

    def test_products_collapse_to_distinct_architectures(self):
        engines = plan_engines(spec(engine={"targets": ["H100", "A100", "H200", "9.0", "L4"]}), CONFIG)
        assert [(e.target, e.architecture) for e in engines] == [("H100", "sm90"), ("A100", "sm80"), ("L4", "sm89")]
        assert len({e.key for e in engines}) == 3

    def test_onnxruntime_defaults_to_cpu(self):
        [e] = plan_engines(spec(engine={"backend": "onnxruntime"}), CONFIG)
        assert (e.architecture, e.backend_version) == ("cpu", "1.32.0")

    def test_backend_version_is_part_of_the_key(self):
        [old] = plan_engines(spec(), CONFIG)
        [new] = plan_engines(spec(), OperatorConfig(backend_versions={"tensorrt": "10.14.0"}))
        assert old.key != new.key

    @pytest.mark.parametrize("targets,needle", [(["Z9000"], "unknown target"), (["cpu"], "cannot build for")])
    def test_targets_that_cannot_work(self, targets, needle):
        with pytest.raises(ValueError, match=needle):
            plan_engines(spec(engine={"targets": targets}), CONFIG)


class TestBuildJob:
    def job(self, **over):
        s = spec(**over)
        return manifests.build_job(MODEL, s, plan_engines(s, CONFIG)[0], CONFIG)

    def test_identity_labels_and_owner(self):
        job = self.job()
        key = plan_engines(spec(), CONFIG)[0].key
        assert job["metadata"]["name"] == f"kiln-build-{key}-sm90"
        labels = job["metadata"]["labels"]
        assert labels[contract.LABEL_KEY] == key and labels[contract.LABEL_TARGET] == "sm90"
        assert labels["app.kubernetes.io/managed-by"] == "kiln"
        assert job["spec"]["template"]["metadata"]["labels"] == labels
        assert job["metadata"]["ownerReferences"] == [{"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceModel",
                                                       "name": "resnet50", "uid": "u-1", "controller": True,
                                                       "blockOwnerDeletion": True}]
        assert job["metadata"]["annotations"][contract.ANN_GENERATION] == "3"

    def test_limits_and_placement_defaults(self):
        job = self.job()
        assert (job["spec"]["activeDeadlineSeconds"], job["spec"]["backoffLimit"],
                job["spec"]["ttlSecondsAfterFinished"]) == (3600, 1, 86400)
        pod = job["spec"]["template"]["spec"]
        assert pod["restartPolicy"] == "Never"
        assert pod["nodeSelector"] == {"kiln.dev/role": "builder"}
        assert pod["tolerations"] == [{"key": "kiln.dev/role", "operator": "Equal", "value": "builder",
                                       "effect": "NoSchedule"}]
        assert pod["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": 1}}
        assert pod["securityContext"]["runAsNonRoot"] is True

    def test_spec_overrides(self):
        job = self.job(build={"timeoutSeconds": 5400, "backoffLimit": 0, "nodeSelector": {"pool": "b"},
                              "tolerations": [], "resources": {"limits": {"nvidia.com/gpu": 2}}})
        pod = job["spec"]["template"]["spec"]
        assert (job["spec"]["activeDeadlineSeconds"], job["spec"]["backoffLimit"]) == (5400, 0)
        assert pod["nodeSelector"] == {"pool": "b"} and pod["tolerations"] == []
        assert pod["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": 2}}

    def test_container_contract(self):
        c = self.job()["spec"]["template"]["spec"]["containers"][0]
        assert c["command"] == ["kiln"]
        assert c["args"][0] == "build" and c["args"][-4:] == ["--cache-dir", "/var/cache/kiln", "--pvc-root",
                                                               "/mnt/models"]
        req = json.loads(c["args"][2])
        e = plan_engines(spec(), CONFIG)[0]
        # The operator's own key inputs travel along, so a builder that disagrees can say why.
        assert enginekey.key_of(req.pop("keyInputs")) == e.key
        assert req == {"namespace": "vision", "name": "resnet50",
                       "model": {"uri": "pvc://models/resnet50/v1.7/resnet50.onnx", "version": "v1.7",
                                 "sha256": "3f" * 32},
                       "engine": {"backend": "tensorrt", "precision": "fp16", "workspaceMiB": 4096,
                                  "profiles": spec()["engine"]["profiles"]},
                       "target": "sm90", "key": e.key}
        assert (c["terminationMessagePath"], c["terminationMessagePolicy"]) == ("/dev/termination-log",
                                                                                "FallbackToLogsOnError")
        assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                        "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}

    def test_volumes_cache_rw_and_pvc_source_ro(self):
        pod = self.job(cache={"claimName": "team-cache"})["spec"]["template"]["spec"]
        mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
        assert mounts["cache"] == {"name": "cache", "mountPath": "/var/cache/kiln"}
        assert mounts["model-source"] == {"name": "model-source", "mountPath": "/mnt/models/models", "readOnly": True}
        vols = {v["name"]: v for v in pod["volumes"]}
        assert vols["cache"]["persistentVolumeClaim"] == {"claimName": "team-cache"}
        assert vols["model-source"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}

    def test_https_source_mounts_no_model_claim(self):
        pod = self.job(model={"uri": "https://example.com/m.onnx"})["spec"]["template"]["spec"]
        assert "model-source" not in {v["name"] for v in pod["volumes"]}

    def test_cpu_backend_asks_no_gpu(self):
        pod = self.job(engine={"backend": "onnxruntime"})["spec"]["template"]["spec"]
        assert "nvidia.com/gpu" not in json.dumps(pod["containers"][0]["resources"])


class TestJobOutcome:
    def pod(self, message, exit_code=0):
        return {"status": {"containerStatuses": [{"name": "build", "state": {"terminated": {
            "exitCode": exit_code, "message": message, "finishedAt": "2026-01-01T00:00:00Z"}}}]}}

    def test_job_state(self):
        assert observations.job_state({}).phase == "Active"
        assert observations.job_state({"status": {"conditions": [{"type": "Complete", "status": "True"}]}}).phase == "Succeeded"
        failed = observations.job_state({"status": {"conditions": [{"type": "Failed", "status": "True",
                                                                    "reason": "DeadlineExceeded", "message": "too long"}]}})
        assert (failed.phase, failed.reason, failed.message) == ("Failed", "DeadlineExceeded", "too long")

    def test_result_from_termination_message_or_log_tail(self):
        ok = {"ok": True, "key": "k", "path": "a/b/k"}
        assert observations.termination_result([self.pod(json.dumps(ok))]) == ok
        assert observations.termination_result([self.pod("building...\nstill\n" + json.dumps(ok))]) == ok
        assert observations.termination_result([self.pod("")]) is None
        assert observations.termination_result([]) is None

    def test_failure_message_names_reason_and_job_condition(self):
        pod = self.pod(json.dumps({"ok": False, "reason": "DigestMismatch", "message": "got 12ab"}), exit_code=4)
        reason, message = observations.failure_message(observations.JobState("Failed", "BackoffLimitExceeded", "limit"), [pod])
        assert reason == "BuildFailed"
        assert message == "DigestMismatch: got 12ab; Job BackoffLimitExceeded: limit"

    def test_failure_without_json_uses_the_exit_code(self):
        reason, message = observations.failure_message(observations.JobState("Failed", "BackoffLimitExceeded"), [self.pod("OOM", 7)])
        assert message.startswith("exit code 7 (OutOfDisk): OOM")


class TestRuntimeDeployment:
    def deployment(self, results=None, include_replicas=True, **over):
        s = spec(**over)
        engines = plan_engines(s, CONFIG)
        results = results if results is not None else {
            e.index_key: {"path": f"vision/resnet50/{e.key}"} for e in engines}
        return manifests.runtime_deployment(MODEL, s, engines, results, CONFIG, include_replicas=include_replicas), engines

    def test_args_contract(self):
        dep, [e] = self.deployment()
        c = dep["spec"]["template"]["spec"]["containers"][0]
        assert c["args"][:8] == ["serve", "--model-name", "resnet50", "--model-version", "v1.7", "--cache-dir",
                                 "/var/cache/kiln", "--engine"]
        assert c["args"][8] == f"sm90=vision/resnet50/{e.key}"
        runtime = {k: v for k, v in spec()["runtime"].items() if k != "replicas"}
        assert json.loads(c["args"][c["args"].index("--runtime-spec") + 1]) == runtime
        assert c["args"][-6:] == ["--port", "8080", "--grpc-port", "8081", "--shadow-config", "/etc/kiln/shadow/shadow.json"]
        assert c["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"},
                              {"name": "grpc", "containerPort": 8081, "protocol": "TCP"}]

    def test_the_stable_pods_read_the_shadow_config_from_an_optional_configmap_and_the_canarys_do_not(self):
        s = spec()
        engines = plan_engines(s, CONFIG)
        results = {e.index_key: {"path": f"vision/resnet50/{e.key}"} for e in engines}
        stable = manifests.runtime_deployment(MODEL, s, engines, results, CONFIG)["spec"]["template"]["spec"]
        assert {"name": "shadow", "configMap": {"name": "resnet50-shadow", "optional": True}} in stable["volumes"]
        assert {"name": "shadow", "mountPath": "/etc/kiln/shadow", "readOnly": True} in stable["containers"][0]["volumeMounts"]
        canary = manifests.runtime_deployment(MODEL, s, engines, results, CONFIG, track=manifests.CANARY)
        pod = canary["spec"]["template"]["spec"]
        assert "--shadow-config" not in pod["containers"][0]["args"] and "shadow" not in [v["name"] for v in pod["volumes"]]

    def test_a_deleted_pod_serves_on_while_its_endpoints_go_then_drains(self):
        dep, _ = self.deployment()
        pod = dep["spec"]["template"]["spec"]
        assert pod["containers"][0]["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
        assert pod["terminationGracePeriodSeconds"] == 35  # the sleep, then kiln serve's 30 s drain

    def test_the_service_selects_the_canary_only_in_a_weighted_replica_ratio_step(self):
        replica_ratio, gateway = spec(), spec(rollout={"traffic": {"mechanism": "GatewayAPI", "httpRoute": "r"}})
        stable_only = {"kiln.dev/model": "resnet50", "kiln.dev/track": "stable"}
        assert manifests.runtime_service(MODEL, replica_ratio)["spec"]["selector"] == stable_only
        assert manifests.runtime_service(MODEL, replica_ratio, both_tracks=True)["spec"]["selector"] == {
            "kiln.dev/model": "resnet50"}
        assert manifests.runtime_service(MODEL, gateway, both_tracks=True)["spec"]["selector"] == stable_only

    def test_a_samples_file_is_read_from_the_models_claim_mounted_read_only(self):
        dep, _ = self.deployment()
        pod = dep["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert (c["terminationMessagePath"], c["terminationMessagePolicy"]) == ("/dev/termination-log",
                                                                              "FallbackToLogsOnError")
        assert "--samples-file" not in c["args"] and [v["name"] for v in pod["volumes"]] == ["cache", "tmp", "shm", "shadow"]
        dep, _ = self.deployment(runtime={"warmup": {"samplesFile": "checks/samples.json"}})
        pod = dep["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert c["args"][c["args"].index("--samples-file") + 1] == "/mnt/models/models/resnet50/v1.7/checks/samples.json"
        assert {"name": "model-source", "mountPath": "/mnt/models/models", "readOnly": True} in c["volumeMounts"]
        assert {"name": "model-source", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod["volumes"]
        inline = {"samples": [{"inputs": [{"name": "input", "shape": [1], "datatype": "FP32", "data": [0.5]}]}]}
        dep, _ = self.deployment(runtime={"warmup": inline})
        c = dep["spec"]["template"]["spec"]["containers"][0]
        assert json.loads(c["args"][c["args"].index("--runtime-spec") + 1])["warmup"]["samples"] == inline["samples"]
        assert "--samples-file" not in c["args"]

    def test_a_runtime_port_on_the_grpc_port_moves_grpc_up_one(self):
        dep, _ = self.deployment(runtime={"port": 8081})
        c = dep["spec"]["template"]["spec"]["containers"][0]
        assert c["args"][-6:-2] == ["--port", "8081", "--grpc-port", "8082"]
        assert [p["containerPort"] for p in c["ports"]] == [8081, 8082]

    def test_sequences_get_the_store_password_from_the_secret_never_the_args(self):
        sequences = {"states": [{"input": "past", "output": "present"}],
                     "store": {"type": "redis", "address": "redis.cache.svc:6379",
                               "passwordSecretRef": {"name": "kiln-redis", "key": "password"}}}
        dep, _ = self.deployment(runtime={"sequences": sequences})
        c = dep["spec"]["template"]["spec"]["containers"][0]
        assert c["env"] == [
            {"name": "KILN_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "KILN_SEQUENCE_STORE_PASSWORD",
             "valueFrom": {"secretKeyRef": {"name": "kiln-redis", "key": "password"}}}]
        passed = json.loads(c["args"][c["args"].index("--runtime-spec") + 1])["sequences"]
        assert passed["store"]["address"] == "redis.cache.svc:6379"
        assert passed["store"]["passwordSecretRef"] == {"name": "kiln-redis", "key": "password"}
        # The Service stays plain: any pod continues any sequence from the store.
        svc = manifests.runtime_service(MODEL, spec(runtime={"sequences": sequences}))
        assert "sessionAffinity" not in svc["spec"] and svc["spec"]["selector"] == {"kiln.dev/model": "resnet50",
                                                                                    "kiln.dev/track": "stable"}
        # The build is told the pairs, to check them against the engine (not part of the key).
        [e] = plan_engines(spec(runtime={"sequences": sequences}), CONFIG)
        request = manifests.build_request(MODEL, spec(runtime={"sequences": sequences}), e)
        assert request["sequenceStates"] == [{"input": "past", "output": "present"}]
        assert e.key == plan_engines(spec(), CONFIG)[0].key

    def test_a_stateless_model_has_no_sequence_env(self):
        dep, _ = self.deployment()
        assert "env" not in dep["spec"]["template"]["spec"]["containers"][0]

    def test_a_cpu_model_sees_no_gpu(self):
        # Its image says NVIDIA_VISIBLE_DEVICES=all: on a GPU node it would see every GPU.
        dep, _ = self.deployment(engine={"backend": "onnxruntime", "precision": "fp32"})
        c = dep["spec"]["template"]["spec"]["containers"][0]
        assert c["env"] == [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]
        assert c["resources"] == {"requests": {"cpu": "1", "memory": "2Gi"}}
        sequences = {"states": [{"input": "past", "output": "present"}]}
        dep, _ = self.deployment(engine={"backend": "onnxruntime", "precision": "fp32"}, runtime={"sequences": sequences})
        assert [v["name"] for v in dep["spec"]["template"]["spec"]["containers"][0]["env"]] == [
            "KILN_NAMESPACE", "NVIDIA_VISIBLE_DEVICES"]
        # A GPU model's variable is the device plugin's: what it allocated.
        for engine in ({"targets": ["H100"]}, {"backend": "onnxruntime", "precision": "fp32", "targets": ["cpu", "sm90"]}):
            dep, _ = self.deployment(engine=engine)
            assert "env" not in dep["spec"]["template"]["spec"]["containers"][0], engine

    def test_one_engine_flag_per_architecture(self):
        dep, engines = self.deployment(engine={"targets": ["A100", "H100"]})
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        assert [args[i + 1] for i, a in enumerate(args) if a == "--engine"] == [
            f"sm80=vision/resnet50/{engines[0].key}", f"sm90=vision/resnet50/{engines[1].key}"]

    def test_probes_and_startup_budget(self):
        dep, _ = self.deployment()
        c = dep["spec"]["template"]["spec"]["containers"][0]
        assert c["startupProbe"]["httpGet"] == {"path": "/v2/models/resnet50/ready", "port": "http"}
        assert c["readinessProbe"]["httpGet"]["path"] == "/v2/models/resnet50/ready"
        assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
        assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] == 600
        [e] = plan_engines(spec(), CONFIG)
        measured, _ = self.deployment(results={e.index_key: {"path": "p", "loadSeconds": 12.5}})
        probe = measured["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
        assert probe["periodSeconds"] * probe["failureThreshold"] == 60  # 3 x 12.5 s, at least 60 s

    @pytest.mark.parametrize("load_seconds, budget", [(None, 600), (12.5, 60), (400.0, 1200)])
    def test_the_load_deadline_fires_before_the_startup_probe_gives_up(self, load_seconds, budget):
        # A hung engine read ends as a not-ready model that says why, a little before the
        # kubelet restarts the pod; and a slow engine's load is never cut short by a
        # fixed default shorter than the probe allows.
        [e] = plan_engines(spec(), CONFIG)
        result = {"path": "p", **({"loadSeconds": load_seconds} if load_seconds else {})}
        dep, _ = self.deployment(results={e.index_key: result})
        c = dep["spec"]["template"]["spec"]["containers"][0]
        probe = c["startupProbe"]
        assert probe["periodSeconds"] * probe["failureThreshold"] == budget
        timeout = float(c["args"][c["args"].index("--load-timeout-seconds") + 1])
        assert timeout == budget - 10

    def test_security_and_volumes(self):
        dep, _ = self.deployment()
        pod = dep["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                        "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}
        assert {"name": "cache", "mountPath": "/var/cache/kiln", "readOnly": True} in c["volumeMounts"]
        assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
        vols = {v["name"]: v for v in pod["volumes"]}
        assert vols["cache"]["persistentVolumeClaim"] == {"claimName": "kiln-engine-cache", "readOnly": True}
        assert vols["tmp"] == {"name": "tmp", "emptyDir": {}}
        # The front-end workers' shared memory: 32 MiB for each of up to 16 (auto).
        assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        assert vols["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "512Mi"}
        assert c["resources"] == {"limits": {"nvidia.com/gpu": 1}}

    def test_front_end_workers_reach_the_pod(self):
        dep, _ = self.deployment(runtime={"frontendWorkers": 6})
        pod = dep["spec"]["template"]["spec"]
        args = pod["containers"][0]["args"]
        assert json.loads(args[args.index("--runtime-spec") + 1])["frontendWorkers"] == 6
        assert {v["name"]: v for v in pod["volumes"]}["shm"]["emptyDir"]["sizeLimit"] == "192Mi"

    def test_labels_annotations_selector(self):
        dep, [e] = self.deployment()
        tmpl = dep["spec"]["template"]["metadata"]
        assert tmpl["annotations"] == {"prometheus.io/scrape": "true", "prometheus.io/port": "8080",
                                       "prometheus.io/path": "/metrics", contract.LABEL_ENGINE_KEY: e.key}
        assert tmpl["labels"][contract.LABEL_MODEL] == "resnet50" and tmpl["labels"][contract.LABEL_ENGINE_KEY] == e.key
        assert dep["spec"]["selector"] == {"matchLabels": {contract.LABEL_MODEL: "resnet50", contract.LABEL_TRACK: "stable"}}
        assert dep["metadata"]["name"] == "resnet50-runtime"

    def test_replicas_left_out_when_autoscaled(self):
        dep, _ = self.deployment()
        assert dep["spec"]["replicas"] == 2
        auto, _ = self.deployment(include_replicas=False, autoscaling={"enabled": True})
        assert "replicas" not in auto["spec"]
        assert manifests.desired_replicas(spec(autoscaling={"enabled": True, "minReplicas": 3})) == 3

    def test_placement_passes_through(self):
        dep, _ = self.deployment(runtime={"nodeSelector": {"gpu": "h100"},
                                          "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]})
        pod = dep["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"gpu": "h100"} and pod["tolerations"][0]["key"] == "nvidia.com/gpu"


class TestRuntimeService:
    def test_port_and_selector(self):
        svc = manifests.runtime_service(MODEL, spec())
        assert svc["metadata"]["name"] == "resnet50"
        assert svc["spec"]["selector"] == {contract.LABEL_MODEL: "resnet50", contract.LABEL_TRACK: "stable"}
        assert svc["spec"]["ports"] == [{"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"},
                                        {"name": "grpc", "port": 8081, "targetPort": "grpc", "protocol": "TCP",
                                         "appProtocol": "grpc"}]


class TestNames:
    """Every name and label value Kiln derives from a model's name fits Kubernetes' limits for
    the longest name the CRD accepts (its metadata.name rules), and that limit is no tighter
    than the longest derived name needs."""

    DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # Service names, at most 63
    SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")  # at most 253
    LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")  # at most 63

    @staticmethod
    def accepted(name: str) -> bool:
        return specmod.validate({**MODEL, "metadata": {"name": name, "namespace": "vision"},
                                 "spec": {"model": {"uri": "pvc://m/m.onnx", "version": "1"}}}) == []

    def objects(self, name: str) -> list[dict]:
        model = {**MODEL, "metadata": {**MODEL["metadata"], "name": name}}
        s = spec(rollout={"traffic": {"mechanism": "GatewayAPI", "httpRoute": "route"}})
        engines = plan_engines(s, CONFIG)
        results = {e.index_key: {"path": f"vision/{name}/{e.key}"} for e in engines}
        return ([manifests.runtime_deployment(model, s, engines, results, CONFIG, track=t) for t in (manifests.STABLE, manifests.CANARY)]
                + [manifests.runtime_service(model, s, t) for t in (manifests.STABLE, manifests.CANARY)] + [manifests.build_job(model, s, engines[0], CONFIG)])

    def problems(self, name: str) -> list[str]:
        found = []
        for obj in self.objects(name):
            meta, spec_ = obj["metadata"], obj["spec"]
            own = obj["metadata"]["name"]
            if obj["kind"] == "Service" and not (len(own) <= 63 and self.DNS1035.fullmatch(own)):
                found.append(f"Service name {own}")
            if not (len(own) <= 253 and self.SUBDOMAIN.fullmatch(own)):
                found.append(f"{obj['kind']} name {own}")
            pod = (spec_.get("template") or {}).get("metadata") or {}
            for labels in (meta.get("labels"), pod.get("labels"), spec_.get("selector"),
                           (spec_.get("selector") or {}).get("matchLabels")):
                for k, v in (labels or {}).items():
                    if isinstance(v, str) and not (len(v) <= 63 and self.LABEL_VALUE.fullmatch(v)):
                        found.append(f"{obj['kind']} {own} label {k}={v}")
        return found

    def test_the_longest_name_the_crd_accepts_fits_every_object_and_one_more_would_not(self):
        longest = next(n for n in range(1, 254) if not self.accepted("m" * (n + 1)))
        assert self.problems("m" * longest) == []
        assert self.problems("m" * (longest + 1)) == [f"Service name {'m' * (longest + 1)}-canary"]

    @pytest.mark.parametrize("name", ["dotted.name", "9lives", "a-"])
    def test_a_name_no_service_can_carry_is_refused(self, name):
        assert not self.accepted(name)


class TestPatches:
    def test_merge_patch_between_removes_and_changes(self):
        old = {"a": 1, "b": {"c": 2, "d": 3}, "l": [1]}
        new = {"a": 1, "b": {"c": 5}, "l": [1, 2], "e": "x"}
        assert manifests.merge_patch_between(old, new) == {"b": {"c": 5, "d": None}, "l": [1, 2], "e": "x"}

    def test_with_applied_records_the_manifest_and_hash(self):
        svc = manifests.runtime_service(MODEL, spec())
        applied = manifests.with_applied(svc)
        ann = applied["metadata"]["annotations"]
        assert json.loads(ann[contract.ANN_APPLIED]) == svc
        assert ann[contract.ANN_APPLIED_HASH] == manifests.manifest_hash(svc)


class TestHTTPRouteWeightsPatch:
    @staticmethod
    def route(*rules: list[dict]) -> dict:
        return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
                "metadata": {"name": "resnet50", "namespace": "ml"},
                "spec": {"parentRefs": [{"name": "gw"}], "rules": [{"backendRefs": refs} for refs in rules]}}

    def test_sets_each_named_backends_weight_after_testing_its_name(self):
        route = self.route([{"name": "resnet50", "port": 8080, "weight": 90},
                            {"name": "resnet50-canary", "port": 8080, "weight": 10}])
        assert manifests.route_weights_patch(route, {"resnet50": 50, "resnet50-canary": 50}) == [
            {"op": "test", "path": "/spec/rules/0/backendRefs/0/name", "value": "resnet50"},
            {"op": "replace", "path": "/spec/rules/0/backendRefs/0/weight", "value": 50},
            {"op": "test", "path": "/spec/rules/0/backendRefs/1/name", "value": "resnet50-canary"},
            {"op": "replace", "path": "/spec/rules/0/backendRefs/1/weight", "value": 50},
        ]

    def test_every_rule_and_only_the_named_backends(self):
        route = self.route([{"name": "other", "weight": 3}, {"name": "resnet50", "weight": 100}],
                           [{"name": "resnet50"}])
        assert manifests.route_weights_patch(route, {"resnet50": 0}) == [
            {"op": "test", "path": "/spec/rules/0/backendRefs/1/name", "value": "resnet50"},
            {"op": "replace", "path": "/spec/rules/0/backendRefs/1/weight", "value": 0},
            {"op": "test", "path": "/spec/rules/1/backendRefs/0/name", "value": "resnet50"},
            # no weight set (the API's default, 1): `add`, since `replace` needs the member
            {"op": "add", "path": "/spec/rules/1/backendRefs/0/weight", "value": 0},
        ]

    def test_a_backend_in_no_rule_names_the_route(self):
        route = self.route([{"name": "resnet50", "weight": 100}])
        with pytest.raises(ValueError, match="HTTPRoute ml/resnet50 has no backendRef named resnet50-canary"):
            manifests.route_weights_patch(route, {"resnet50": 90, "resnet50-canary": 10})

    def test_a_route_without_rules(self):
        route = {"metadata": {"name": "r", "namespace": "ml"}, "spec": {}}
        assert manifests.route_weights_patch(route, {}) == []
        with pytest.raises(ValueError, match="HTTPRoute ml/r"):
            manifests.route_weights_patch(route, {"x": 1})


class TestObservedDeployment:
    def test_observe_deployment(self):
        dep = {"metadata": {"generation": 4},
               "spec": {"replicas": 3, "template": {"metadata": {"labels": {contract.LABEL_ENGINE_KEY: "k"}}}},
               "status": {"observedGeneration": 4, "replicas": 3, "updatedReplicas": 3, "readyReplicas": 2}}
        o = observations.observe_deployment(dep)
        assert (o.exists, o.engine_key, o.ready, o.desired, o.rolled_out) == (True, "k", 2, 3, True)
        assert not observations.observe_deployment({**dep, "status": {"observedGeneration": 3}}).rolled_out
        assert not observations.observe_deployment(None).exists

    def test_a_rollout_the_controller_has_not_completed_is_not_rolled_out(self):
        # Seen on the real Deployment controller: a new Deployment reports its one pod as
        # updated before it is ready; only Progressing/NewReplicaSetAvailable means done.
        status = {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 0}
        dep = {"metadata": {"generation": 1}, "spec": {"replicas": 1}}
        starting = {**status, "conditions": [{"type": "Progressing", "status": "True", "reason": "ReplicaSetUpdated"}]}
        done = {**status, "conditions": [{"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"}]}
        assert not observations.observe_deployment({**dep, "status": starting}).rolled_out
        assert observations.observe_deployment({**dep, "status": done}).rolled_out

    def test_a_generation_that_only_scales_a_rolled_out_template_is_no_rollout(self):
        # 1 -> 3 replicas at generation 5, the controller still at 4: a scale, said so by Kiln.
        status = {"observedGeneration": 4, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1}
        scaled = {"metadata": {"generation": 5, "annotations": {observations.ANN_SCALED_FROM: "4"}},
                  "spec": {"replicas": 3}, "status": status}
        assert observations.observe_deployment(scaled).rolled_out
        # The controller saw it, the ReplicaSet has not made the pods yet: still a scale.
        assert observations.observe_deployment({**scaled, "status": {**status, "observedGeneration": 5}}).rolled_out
        # Without the word, or after a later change (a template), it is not known yet.
        assert not observations.observe_deployment({**scaled, "metadata": {"generation": 5}}).rolled_out
        assert not observations.observe_deployment({**scaled, "metadata": {**scaled["metadata"], "generation": 6}}).rolled_out


class TestWarmupFailure:
    ARGS = ["serve", "--model-name", "resnet50"]

    def pod(self, where="lastState", code=9, message="WarmupFailed: sample 1 (of 1): the request is refused: x",
            args=None, deleted=False, finished="2026-01-01T00:00:01Z"):
        meta = {"name": "p", **({"deletionTimestamp": "2026-01-01T00:00:09Z"} if deleted else {})}
        term = {"exitCode": code, "message": message, "finishedAt": finished}
        return {"metadata": meta, "spec": {"containers": [{"name": "runtime", "args": args or self.ARGS}]},
                "status": {"containerStatuses": [{"name": "runtime", where: {"terminated": term}}]}}

    def test_the_reason_of_a_pod_of_the_current_template(self):
        assert observations.warmup_failure([self.pod()], self.ARGS) == "sample 1 (of 1): the request is refused: x"
        assert observations.warmup_failure([self.pod("state")], self.ARGS) == "sample 1 (of 1): the request is refused: x"
        newest = self.pod(message="WarmupFailed: newer", finished="2026-01-01T00:00:07Z")
        assert observations.warmup_failure([self.pod(), newest], self.ARGS) == "newer"

    def test_anything_else_is_no_warm_up_failure(self):
        assert observations.warmup_failure([], self.ARGS) is None
        assert observations.warmup_failure([self.pod(code=1, message="Traceback ...")], self.ARGS) is None
        assert observations.warmup_failure([self.pod(code=137, message="")], self.ARGS) is None
        assert observations.warmup_failure([self.pod(args=["serve", "--old"])], self.ARGS) is None
        assert observations.warmup_failure([self.pod(deleted=True)], self.ARGS) is None
        assert observations.warmup_failure([{"metadata": {}, "status": {}}], self.ARGS) is None

    def test_a_message_that_is_the_logs_tail_still_says_the_exit_code(self):
        assert observations.warmup_failure([self.pod(message="some log line")], self.ARGS) == "exit code 9"


class TestTemplateDrift:
    def applied(self):
        s = spec()
        engines = plan_engines(s, CONFIG)
        return manifests.runtime_deployment(MODEL, s, engines, {e.index_key: {"path": "p"} for e in engines}, CONFIG)

    def live(self, **container):
        applied = self.applied()
        c = json.loads(json.dumps(applied["spec"]["template"]["spec"]["containers"][0]))
        # What an API server adds: defaults inside probes, quantities as strings.
        c["readinessProbe"]["successThreshold"] = 1
        c["readinessProbe"]["httpGet"]["scheme"] = "HTTP"
        c["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
        c["imagePullPolicy"] = "IfNotPresent"
        c.update(container)
        return {"spec": {"template": {"spec": {"containers": observations.slim_containers([c])}}}}

    def test_defaults_the_api_server_adds_are_no_drift(self):
        assert observations.template_drift(self.live(), self.applied()) == []

    @pytest.mark.parametrize("edit,field", [
        ({"image": "evil:1"}, "runtime.image"),
        ({"args": ["serve"]}, "runtime.args"),
        ({"env": [{"name": "X", "value": "1"}]}, "runtime.env"),
        ({"resources": {"limits": {"nvidia.com/gpu": "2"}}}, "runtime.resources"),
        ({"livenessProbe": {"exec": {"command": ["true"]}}}, "runtime.livenessProbe"),
    ])
    def test_edits_that_matter(self, edit, field):
        assert observations.template_drift(self.live(**edit), self.applied()) == [field]

    def test_quantities_compare_by_value(self):
        assert observations._covers({"cpu": "1", "memory": "2048Mi"}, {"cpu": "1000m", "memory": "2Gi"}, quantities=True)

    def test_an_index_without_containers_shows_no_drift(self):
        assert observations.template_drift({"spec": {"template": {"metadata": {}}}}, self.applied()) == []
