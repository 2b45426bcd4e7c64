{{/*
The chart's name, or nameOverride.
*/}}
{{- define "capstan.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The full name of the release's resources, truncated to 63 characters because some Kubernetes
name fields are limited to this (by the DNS naming spec). The release name alone when it
already contains the chart's name.
*/}}
{{- define "capstan.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The chart's name and version, for the helm.sh/chart label.
*/}}
{{- define "capstan.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The labels of every resource.
*/}}
{{- define "capstan.labels" -}}
helm.sh/chart: {{ include "capstan.chart" . }}
{{ include "capstan.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: operator
{{- end -}}

{{/*
The selector labels (immutable in a Deployment or DaemonSet: never the chart's version).
*/}}
{{- define "capstan.selectorLabels" -}}
app.kubernetes.io/name: {{ include "capstan.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/*
The name of the ServiceAccount.
*/}}
{{- define "capstan.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "capstan.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create=false: name an existing ServiceAccount" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
An image reference from an image value (repository, tag, digest) and the root context:
`repository@digest`, or `repository:tag` with the chart's appVersion as the default tag.
*/}}
{{- define "capstan.image" -}}
{{- $image := index . 0 -}}
{{- $root := index . 1 -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $image.repository $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag) -}}
{{- end -}}
{{- end -}}

{{/*
The namespaces the operator watches, comma-separated; empty for the whole cluster.
`watchNamespaces`, or the release namespace with namespaced RBAC.
*/}}
{{- define "capstan.watchNamespaces" -}}
{{- if .Values.watchNamespaces -}}
{{- join "," .Values.watchNamespaces -}}
{{- else if eq .Values.rbac.scope "namespaced" -}}
{{- .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{/*
"true" when the operator adds finalizers (`finalizers`, with `auto` resolved by the mode).
*/}}
{{- define "capstan.finalizers" -}}
{{- if eq .Values.finalizers "enabled" -}}
true
{{- else if eq .Values.finalizers "disabled" -}}
false
{{- else -}}
{{- eq .Values.mode "deployment" -}}
{{- end -}}
{{- end -}}

{{/*
The Lease of leader election.
*/}}
{{- define "capstan.leaseName" -}}
{{- default (include "capstan.fullname" .) .Values.leaderElection.leaseName -}}
{{- end -}}

{{/*
The sharding ring's name (its member Leases' label and name prefix).
*/}}
{{- define "capstan.ringName" -}}
{{- default (include "capstan.fullname" .) .Values.sharding.ringName -}}
{{- end -}}

{{/*
The peering object's name.
*/}}
{{- define "capstan.peeringName" -}}
{{- default (include "capstan.fullname" .) .Values.peering.name -}}
{{- end -}}

{{/*
Refuses combinations of values that would deploy an unsafe or broken operator; each message
says what to change. Rendered by templates/validate.yaml.
*/}}
{{- define "capstan.validate" -}}
{{- if and (eq .Values.mode "deployment") (gt (int .Values.replicas) 1) (not .Values.leaderElection.enabled) (not .Values.sharding.enabled) -}}
{{- fail (printf "\n\nreplicas=%d needs sharding.enabled=true or leaderElection.enabled=true: without either every replica would handle every object at the same time. Set sharding.enabled=true (every replica handles a share of the objects), leaderElection.enabled=true (one replica handles them all, the others stand by), or replicas=1." (int .Values.replicas)) -}}
{{- end -}}
{{- if and .Values.sharding.enabled .Values.leaderElection.enabled -}}
{{- fail "\n\nsharding.enabled=true with leaderElection.enabled=true: sharding replaces leader election (every replica handles its share; none stands by). Set one of them." -}}
{{- end -}}
{{- if and .Values.sharding.enabled (eq .Values.mode "daemonset") -}}
{{- fail "\n\nsharding.enabled=true needs mode=deployment: in daemonset mode every node's operator already handles its own node's share." -}}
{{- end -}}
{{- if and (eq .Values.mode "daemonset") (eq .Values.finalizers "enabled") (not .Values.daemonset.nodeCleanup) -}}
{{- fail "\n\nmode=daemonset with finalizers=enabled needs daemonset.nodeCleanup=true: a finalizer added by a node's operator would block the deletion of its objects forever once that node is gone. Set daemonset.nodeCleanup=true, or finalizers=auto (no finalizers in daemonset mode)." -}}
{{- end -}}
{{- if and .Values.daemonset.nodeStorage.enabled (ne .Values.mode "daemonset") -}}
{{- fail "\n\ndaemonset.nodeStorage.enabled=true needs mode=daemonset: node-local storage keeps per-node state on each node." -}}
{{- end -}}
{{- $type := (.Values.updateStrategy | default dict).type | default "" -}}
{{- if include "capstan.nodeStorage" . -}}
{{- $path := include "capstan.nodeStoragePath" . -}}
{{- $shared := list "" "/var" "/var/lib" "/var/run" "/var/tmp" "/var/log" "/tmp" "/run" "/etc" "/usr" "/opt" "/srv" "/mnt" "/home" "/root" "/dev" "/proc" "/sys" "/boot" "/bin" "/sbin" "/lib" "/lib64" -}}
{{- if or (not (hasPrefix "/" $path)) (has $path $shared) (regexMatch "(^|/)\\.\\.?(/|$)" $path) (contains "//" $path) -}}
{{- fail (printf "\n\ndaemonset.nodeStorage.path=%q is shared with the rest of the node (or not a plain absolute path): the prepare step gives the directory to the operator's user, and every release needs a directory of its own. Leave it empty for /var/lib/capstan/%s/%s, or name a directory only this release uses." $path .Release.Namespace .Release.Name) -}}
{{- end -}}
{{- $surge := toString ((((.Values.updateStrategy | default dict).rollingUpdate) | default dict).maxSurge | default 0) -}}
{{- if and (ne $surge "0") (ne $surge "0%") -}}
{{- fail (printf "\n\nupdateStrategy.rollingUpdate.maxSurge=%s with daemonset.nodeStorage.enabled=true: a surge pod starts while the old pod of its node still holds the node-local storage, and waits for it until the old pod is gone, which a surge rollout waits for the new pod to be ready first. Set maxSurge=0 (and maxUnavailable=1, the default)." $surge) -}}
{{- end -}}
{{- end -}}
{{- if and (eq .Values.mode "deployment") (eq $type "OnDelete") -}}
{{- fail "\n\nupdateStrategy.type=OnDelete is a DaemonSet strategy; a Deployment takes Recreate or RollingUpdate." -}}
{{- end -}}
{{- if and (eq .Values.mode "daemonset") (eq $type "Recreate") -}}
{{- fail "\n\nupdateStrategy.type=Recreate is a Deployment strategy; a DaemonSet takes RollingUpdate or OnDelete." -}}
{{- end -}}
{{- if and (eq .Values.mode "deployment") (eq $type "RollingUpdate") (not .Values.leaderElection.enabled) (not .Values.sharding.enabled) -}}
{{- fail "\n\nupdateStrategy.type=RollingUpdate without leader election runs the old and the new operator at the same time during an update, and both would handle the same objects. Set leaderElection.enabled=true, or leave updateStrategy empty (Recreate)." -}}
{{- end -}}
{{- if not .Values.handler.image.repository -}}
{{- fail "\n\nhandler.image.repository is required: the image of your operator, which runs in the handler container. For the demo operator, set handler.image.repository=ghcr.io/capstan-dev/capstan-example." -}}
{{- end -}}
{{- if and (eq (trimSuffix "/" .Values.capstan.persistencePrefix) "kopf.zalando.org") (ne .Values.capstan.persistence "kopf") -}}
{{- fail "\n\ncapstan.persistencePrefix=kopf.zalando.org without capstan.persistence=kopf keeps Capstan's own key formats and finalizer under kopf's prefix: kopf's progress records would not be recognised and kopf's finalizers (kopf.zalando.org/KopfFinalizerMarker) would stay on the objects. To take over from kopf, set capstan.persistence=kopf (it uses kopf's prefix) and leave capstan.persistencePrefix empty." -}}
{{- end -}}
{{- if and .Values.handler.rbac.rules (not .Values.handler.apiAccess) -}}
{{- fail "\n\nhandler.rbac.rules needs handler.apiAccess=true: without it the handler container has no API token to use them. Set handler.apiAccess=true, or remove handler.rbac.rules." -}}
{{- end -}}
{{- if and .Values.metrics.serviceMonitor.enabled (not .Values.metrics.enabled) -}}
{{- fail "\n\nmetrics.serviceMonitor.enabled=true needs metrics.enabled=true (the ServiceMonitor scrapes the metrics Service)." -}}
{{- end -}}
{{- if .Values.webhooks.enabled -}}
{{- $source := .Values.webhooks.certificate.source -}}
{{- if and (eq $source "selfSigned") (ne .Values.webhooks.configurations "managed") -}}
{{- fail "\n\nwebhooks.certificate.source=selfSigned needs webhooks.configurations=managed: the generated CA exists only inside the controller, which puts it into the configurations it manages. Use certManager or existingSecret to write the configurations yourself." -}}
{{- end -}}
{{- if and (eq $source "certManager") (not .Values.webhooks.certificate.certManager.issuerName) -}}
{{- fail "\n\nwebhooks.certificate.source=certManager needs webhooks.certificate.certManager.issuerName: the cert-manager Issuer or ClusterIssuer that signs the webhook's certificate." -}}
{{- end -}}
{{- if and (eq $source "existingSecret") (not .Values.webhooks.certificate.existingSecret) -}}
{{- fail "\n\nwebhooks.certificate.source=existingSecret needs webhooks.certificate.existingSecret: the name of a kubernetes.io/tls Secret in the release namespace." -}}
{{- end -}}
{{- if and .Values.webhooks.clientCA.secretName .Values.webhooks.clientCA.configMapName -}}
{{- fail "\n\nwebhooks.clientCA takes secretName or configMapName, not both." -}}
{{- end -}}
{{- if and (include "capstan.webhookClientCA" .) (not .Values.webhooks.clientCA.key) -}}
{{- fail "\n\nwebhooks.clientCA.key names the file of the CA bundle in the Secret or ConfigMap (for example ca.crt)." -}}
{{- end -}}
{{- end -}}
{{- range .Values.rbac.resources -}}
{{- range .resources -}}
{{- if contains "*" . -}}
{{- fail "\n\nrbac.resources must name resources; wildcards are not allowed (use rbac.extraRules if you really mean it)." -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The environment of the capstan container: how the chart configures `capstan run`.
*/}}
{{- define "capstan.env" -}}
- name: CAPSTAN_LISTEN
  value: unix:///run/capstan/capstan.sock
# Both address families: an IPv6-only cluster probes over IPv6, others over IPv4 (a `[::]`
# socket accepts both).
- name: CAPSTAN_ADMIN_LISTEN
  value: {{ printf "[::]:%d" (int .Values.capstan.adminPort) | quote }}
- name: CAPSTAN_LOG
  value: {{ .Values.capstan.logLevel | quote }}
- name: CAPSTAN_LOG_FORMAT
  value: {{ .Values.capstan.logFormat | quote }}
- name: CAPSTAN_PERSISTENCE
  value: {{ .Values.capstan.persistence | quote }}
{{- with .Values.capstan.persistencePrefix }}
- name: CAPSTAN_PERSISTENCE_PREFIX
  value: {{ . | quote }}
{{- end }}
{{- with include "capstan.watchNamespaces" . }}
- name: CAPSTAN_NAMESPACES
  value: {{ . | quote }}
{{- end }}
- name: CAPSTAN_FINALIZERS
  value: {{ include "capstan.finalizers" . | quote }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: CAPSTAN_LEADER_ELECTION
  value: {{ .Values.leaderElection.enabled | quote }}
{{- if .Values.leaderElection.enabled }}
- name: CAPSTAN_LEASE_NAME
  value: {{ include "capstan.leaseName" . | quote }}
- name: CAPSTAN_LEASE_NAMESPACE
  value: {{ .Release.Namespace | quote }}
{{- end }}
{{- if .Values.sharding.enabled }}
- name: CAPSTAN_SHARDING
  value: "true"
- name: CAPSTAN_LEASE_NAME
  value: {{ include "capstan.ringName" . | quote }}
- name: CAPSTAN_LEASE_NAMESPACE
  value: {{ .Release.Namespace | quote }}
{{- with .Values.sharding.settle }}
- name: CAPSTAN_SHARDING_SETTLE
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- if .Values.peering.enabled }}
- name: CAPSTAN_PEERING
  value: {{ include "capstan.peeringName" . | quote }}
- name: CAPSTAN_PRIORITY
  value: {{ .Values.peering.priority | int | quote }}
{{- else }}
- name: CAPSTAN_STANDALONE
  value: "true"
{{- end }}
{{- if eq .Values.mode "daemonset" }}
- name: CAPSTAN_NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
- name: CAPSTAN_NODE_CLEANUP
  value: {{ .Values.daemonset.nodeCleanup | quote }}
{{- if .Values.daemonset.nodeStorage.enabled }}
- name: CAPSTAN_NODE_STORAGE
  value: {{ printf "file:%s" (include "capstan.nodeStoragePath" .) | quote }}
- name: CAPSTAN_NODE_STORAGE_CLAIM
  value: {{ include "capstan.nodeStorageClaim" . | quote }}
- name: CAPSTAN_NODE_STORAGE_LIMIT_MIB
  value: {{ .Values.daemonset.nodeStorage.limitMiB | int | quote }}
{{- end }}
{{- end }}
{{- if .Values.handler.apiAccess }}
- name: CAPSTAN_HANDLER_IDENTITY
  value: {{ printf "%s/%s" .Release.Namespace (include "capstan.handlerServiceAccountName" .) | quote }}
- name: CAPSTAN_HANDLER_IDENTITY_DIR
  value: /run/capstan-handler-identity
{{- end }}
{{- if not .Values.rbac.watchCrds }}
- name: CAPSTAN_NO_CRD_WATCH
  value: "true"
{{- end }}
{{- if .Values.webhooks.enabled }}
- name: CAPSTAN_WEBHOOKS
  value: "on"
- name: CAPSTAN_WEBHOOK_LISTEN
  value: {{ printf "[::]:%d" (int .Values.webhooks.port) | quote }}
- name: CAPSTAN_WEBHOOK_SERVICE
  value: {{ include "capstan.webhookService" . | quote }}
- name: CAPSTAN_WEBHOOK_SERVICE_NAMESPACE
  value: {{ .Release.Namespace | quote }}
- name: CAPSTAN_WEBHOOK_SERVICE_PORT
  value: "443"
- name: CAPSTAN_WEBHOOK_TIMEOUT
  value: {{ printf "%ds" (int .Values.webhooks.timeoutSeconds) | quote }}
- name: CAPSTAN_WEBHOOK_EXCLUDE_NAMESPACES
  value: {{ include "capstan.webhookExcludedNamespaces" . | quote }}
{{- if eq .Values.webhooks.configurations "managed" }}
- name: CAPSTAN_WEBHOOK_MANAGED
  value: {{ include "capstan.fullname" . | quote }}
{{- if .Values.webhooks.keepOnExit }}
- name: CAPSTAN_WEBHOOK_KEEP_ON_EXIT
  value: "true"
{{- end }}
{{- else }}
- name: CAPSTAN_WEBHOOK_MANAGED
  value: ""
{{- end }}
{{- if ne .Values.webhooks.certificate.source "selfSigned" }}
- name: CAPSTAN_WEBHOOK_CERT_DIR
  value: /run/capstan-webhook-tls
{{- else }}
- name: CAPSTAN_WEBHOOK_CA_SECRET
  value: {{ include "capstan.webhookCASecret" . | quote }}
{{- end }}
{{- if include "capstan.webhookClientCA" . }}
- name: CAPSTAN_WEBHOOK_CLIENT_CA
  value: {{ printf "/run/capstan-webhook-client-ca/%s" .Values.webhooks.clientCA.key | quote }}
{{- end }}
{{- else }}
- name: CAPSTAN_WEBHOOKS
  value: "off"
{{- end }}
{{- with .Values.capstan.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
A probe on the admin port: (list probe-values path root).
*/}}
{{- define "capstan.probe" -}}
{{- $probe := index . 0 -}}
{{- $path := index . 1 -}}
httpGet:
  path: {{ $path }}
  port: admin
{{- with $probe.initialDelaySeconds }}
initialDelaySeconds: {{ . }}
{{- end }}
periodSeconds: {{ $probe.periodSeconds }}
timeoutSeconds: {{ $probe.timeoutSeconds }}
failureThreshold: {{ $probe.failureThreshold }}
{{- end -}}

{{/*
The capstan container. As a native sidecar (an initContainer) it carries
`restartPolicy: Always`.
*/}}
{{- define "capstan.capstanContainer" -}}
- name: capstan
  image: {{ include "capstan.image" (list .Values.capstan.image .) | quote }}
  imagePullPolicy: {{ .Values.capstan.image.pullPolicy }}
  {{- if .Values.nativeSidecar }}
  restartPolicy: Always
  {{- end }}
  args:
    - run
    {{- with .Values.capstan.extraArgs }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  env:
    {{- include "capstan.env" . | nindent 4 }}
  ports:
    - name: admin
      containerPort: {{ .Values.capstan.adminPort }}
      protocol: TCP
    {{- if .Values.webhooks.enabled }}
    - name: webhook
      containerPort: {{ .Values.webhooks.port }}
      protocol: TCP
    {{- end }}
  {{- if .Values.capstan.startupProbe.enabled }}
  startupProbe:
    {{- include "capstan.probe" (list .Values.capstan.startupProbe "/healthz") | nindent 4 }}
  {{- end }}
  {{- if .Values.capstan.livenessProbe.enabled }}
  livenessProbe:
    {{- include "capstan.probe" (list .Values.capstan.livenessProbe "/healthz") | nindent 4 }}
  {{- end }}
  {{- if .Values.capstan.readinessProbe.enabled }}
  readinessProbe:
    {{- include "capstan.probe" (list .Values.capstan.readinessProbe "/readyz") | nindent 4 }}
  {{- end }}
  {{- with .Values.capstan.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.capstan.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: capstan-socket
      mountPath: /run/capstan
    - name: capstan-api-access
      mountPath: /var/run/secrets/kubernetes.io/serviceaccount
      readOnly: true
    {{- if include "capstan.nodeStorage" . }}
    - name: capstan-node-storage
      mountPath: {{ include "capstan.nodeStoragePath" . | quote }}
    {{- end }}
    {{- if .Values.handler.apiAccess }}
    - name: handler-api-access
      mountPath: /run/capstan-handler-identity
    {{- end }}
    {{- if include "capstan.webhookSecret" . }}
    - name: webhook-tls
      mountPath: /run/capstan-webhook-tls
      readOnly: true
    {{- end }}
    {{- if include "capstan.webhookClientCA" . }}
    - name: webhook-client-ca
      mountPath: /run/capstan-webhook-client-ca
      readOnly: true
    {{- end }}
{{- end -}}

{{/*
"true" when the pods keep per-node state in a directory on their node.
*/}}
{{- define "capstan.nodeStorage" -}}
{{- if and (eq .Values.mode "daemonset") .Values.daemonset.nodeStorage.enabled -}}true{{- end -}}
{{- end -}}

{{/*
The node-local storage directory on the node (mounted at the same path in the pod): the
release's own, `/var/lib/capstan/<namespace>/<release>`, unless set.
*/}}
{{- define "capstan.nodeStoragePath" -}}
{{- .Values.daemonset.nodeStorage.path | default (printf "/var/lib/capstan/%s/%s" .Release.Namespace .Release.Name) | trimSuffix "/" -}}
{{- end -}}

{{/*
The release's claim on its node-local storage directory (`--node-storage-claim`).
*/}}
{{- define "capstan.nodeStorageClaim" -}}
{{- printf "%s/%s" .Release.Namespace .Release.Name -}}
{{- end -}}

{{/*
The init container that gives the node-local storage directory to the pod's user.
*/}}
{{- define "capstan.prepareStorageContainer" -}}
- name: prepare-storage
  image: {{ include "capstan.image" (list .Values.capstan.image .) | quote }}
  imagePullPolicy: {{ .Values.capstan.image.pullPolicy }}
  args:
    - prepare-storage
    - {{ include "capstan.nodeStoragePath" . | quote }}
    - --owner
    - {{ printf "%d:%d" (int (.Values.podSecurityContext.runAsUser | default 65532)) (int (.Values.podSecurityContext.runAsGroup | default 65532)) | quote }}
    - --claim
    - {{ include "capstan.nodeStorageClaim" . | quote }}
  securityContext:
    runAsUser: 0
    runAsNonRoot: false
    allowPrivilegeEscalation: false
    readOnlyRootFilesystem: true
    capabilities:
      drop: [ALL]
      add: [CHOWN, FOWNER]
  volumeMounts:
    - name: capstan-node-storage
      mountPath: {{ include "capstan.nodeStoragePath" . | quote }}
{{- end -}}

{{/*
The handler container: the user's operator, dialing the capstan socket.
*/}}
{{- define "capstan.handlerContainer" -}}
- name: handler
  image: {{ include "capstan.image" (list .Values.handler.image .) | quote }}
  imagePullPolicy: {{ .Values.handler.image.pullPolicy }}
  {{- with .Values.handler.command }}
  command:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.handler.args }}
  args:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  env:
    - name: CAPSTAN_ENDPOINT
      value: unix:///run/capstan/capstan.sock
    {{- with .Values.handler.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with .Values.handler.envFrom }}
  envFrom:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.handler.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.handler.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: capstan-socket
      mountPath: /run/capstan
    {{- if .Values.handler.apiAccess }}
    - name: handler-api-access
      mountPath: /var/run/secrets/kubernetes.io/serviceaccount
      readOnly: true
    {{- end }}
    {{- with .Values.handler.volumeMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}

{{/*
The pod template of the Deployment or DaemonSet.
*/}}
{{- define "capstan.podTemplate" -}}
metadata:
  labels:
    {{- include "capstan.selectorLabels" . | nindent 4 }}
    app.kubernetes.io/component: operator
    {{- with .Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with .Values.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  serviceAccountName: {{ include "capstan.serviceAccountName" . }}
  # The API token is projected into the capstan container only (volume capstan-api-access).
  automountServiceAccountToken: false
  terminationGracePeriodSeconds: {{ .Values.terminationGracePeriodSeconds }}
  {{- with .Values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.podSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- $prepare := and (include "capstan.nodeStorage" .) .Values.daemonset.nodeStorage.prepare }}
  {{- if or .Values.nativeSidecar $prepare }}
  initContainers:
    {{- if $prepare }}
    {{- include "capstan.prepareStorageContainer" . | nindent 4 }}
    {{- end }}
    {{- if .Values.nativeSidecar }}
    {{- include "capstan.capstanContainer" . | nindent 4 }}
    {{- end }}
  {{- end }}
  containers:
    {{- if not .Values.nativeSidecar }}
    {{- include "capstan.capstanContainer" . | nindent 4 }}
    {{- end }}
    {{- include "capstan.handlerContainer" . | nindent 4 }}
  volumes:
    - name: capstan-socket
      emptyDir:
        medium: Memory
        sizeLimit: 1Mi
    # What automounting would give every container, for the capstan container only.
    - name: capstan-api-access
      projected:
        sources:
          - serviceAccountToken:
              path: token
              expirationSeconds: 3607
          - configMap:
              name: kube-root-ca.crt
              items:
                - key: ca.crt
                  path: ca.crt
          - downwardAPI:
              items:
                - path: namespace
                  fieldRef:
                    apiVersion: v1
                    fieldPath: metadata.namespace
    {{- with include "capstan.webhookSecret" . }}
    # The webhook server's certificate (reloaded by the controller when the Secret changes).
    - name: webhook-tls
      secret:
        secretName: {{ . }}
    {{- end }}
    {{- if include "capstan.webhookClientCA" . }}
    # The CA of the client certificates the webhook callers must present (reloaded on change).
    - name: webhook-client-ca
      {{- with .Values.webhooks.clientCA }}
      {{- if .secretName }}
      secret:
        secretName: {{ .secretName }}
      {{- else }}
      configMap:
        name: {{ .configMapName }}
      {{- end }}
      {{- end }}
    {{- end }}
    {{- if .Values.handler.apiAccess }}
    # The handler's own identity: an expiring token of its ServiceAccount, ca.crt and
    # namespace, written and renewed by the controller (`--handler-identity`).
    - name: handler-api-access
      emptyDir:
        medium: Memory
        sizeLimit: 1Mi
    {{- end }}
    {{- if include "capstan.nodeStorage" . }}
    # This node's per-node state (`--node-storage`).
    - name: capstan-node-storage
      hostPath:
        path: {{ include "capstan.nodeStoragePath" . | quote }}
        type: DirectoryOrCreate
    {{- end }}
    {{- with .Values.volumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with .Values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}

{{/*
The rules of the operator's ClusterRole or Role: (list root peering-resource).
*/}}
{{- define "capstan.rules" -}}
{{- $root := index . 0 -}}
{{- $peering := index . 1 -}}
{{- range $root.Values.rbac.resources }}
- apiGroups: [{{ .apiGroup | quote }}]
  resources: {{ toJson .resources }}
  verbs: [get, list, watch, patch]
- apiGroups: [{{ .apiGroup | quote }}]
  resources:
    {{- range .resources }}
    - {{ printf "%s/status" . }}
    {{- end }}
  verbs: [get, patch]
{{- end }}
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- if $root.Values.peering.enabled }}
- apiGroups: [capstan.dev]
  resources: [{{ $peering }}]
  verbs: [get, list, watch, patch, create]
{{- end }}
{{- with $root.Values.rbac.extraRules }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
The handler container's own ServiceAccount (with handler.apiAccess).
*/}}
{{- define "capstan.handlerServiceAccountName" -}}
{{- printf "%s-handler" (include "capstan.fullname" .) -}}
{{- end -}}

{{/*
The labels of the helm test pod: the release and a component of its own, so that the
workload's selector labels never match it.
*/}}
{{- define "capstan.testLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: helm-test
{{- end -}}

{{/*
The webhook Service's name.
*/}}
{{- define "capstan.webhookService" -}}
{{- printf "%s-webhook" (include "capstan.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The Secret holding the webhook certificate; empty when the controller generates it.
*/}}
{{- define "capstan.webhookSecret" -}}
{{- if .Values.webhooks.enabled -}}
{{- if eq .Values.webhooks.certificate.source "certManager" -}}
{{- printf "%s-webhook-tls" (include "capstan.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- else if eq .Values.webhooks.certificate.source "existingSecret" -}}
{{- .Values.webhooks.certificate.existingSecret -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The Secret keeping the CA of the generated webhook certificates, shared by every replica.
*/}}
{{- define "capstan.webhookCASecret" -}}
{{- printf "%s-webhook-ca" (include "capstan.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
"true" when the webhook callers must present a client certificate (webhooks.clientCA).
*/}}
{{- define "capstan.webhookClientCA" -}}
{{- if and .Values.webhooks.enabled (or .Values.webhooks.clientCA.secretName .Values.webhooks.clientCA.configMapName) -}}
true
{{- end -}}
{{- end -}}

{{/*
Namespaces never sent to the webhooks: kube-system, the release namespace and the extra ones.
*/}}
{{- define "capstan.webhookExcludedNamespaces" -}}
{{- concat (list "kube-system" .Release.Namespace) .Values.webhooks.excludeNamespaces | uniq | join "," -}}
{{- end -}}
