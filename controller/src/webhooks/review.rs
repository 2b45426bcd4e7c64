//! `admission.k8s.io` `AdmissionReview` documents: what the API server sends, read strictly
//! enough to answer "400: why" for anything else, and the response it expects back.
//!
//! A review is read in steps that each refuse before the next allocates: a scan of the raw
//! bytes for the nesting depth and the number of values (so that the server can reserve what
//! the trees will cost), then the envelope with the request left as text, then kube's typed
//! `AdmissionReview` with the objects still text, and only then the trees of `object`,
//! `oldObject` and `userInfo` that the handlers receive.
//!
//! Both `admission.k8s.io/v1` and `v1beta1` are read; the response carries the request's own
//! `apiVersion`, as the API server requires. The patch of a mutating response is a JSON Patch,
//! base64-encoded in the document.

use std::borrow::Cow;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::core::{
    ApiResource, DynamicResourceScope, Resource, TypeMeta,
    admission::{AdmissionRequest, AdmissionReview, Operation},
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json, value::RawValue};

/// The largest `uid` accepted (the API server sends UUIDs).
const MAX_UID: usize = 128;
/// The most warnings returned in one response; more are dropped (and the last one says so).
pub const MAX_WARNINGS: usize = 32;
/// The longest warning returned; longer ones are cut.
pub const MAX_WARNING_BYTES: usize = 1024;
/// The longest denial message returned; longer ones are cut.
pub const MAX_MESSAGE_BYTES: usize = 4096;

/// One admission request, as the handlers need it.
#[derive(Clone, Debug, PartialEq)]
pub struct Review {
    /// The document's `apiVersion`, echoed in the response.
    pub api_version: String,
    /// The request uid, echoed in the response.
    pub uid: String,
    /// The resource's group; empty for the core group.
    pub group: String,
    /// The resource's version.
    pub version: String,
    /// The resource's plural name.
    pub resource: String,
    /// The subresource, or empty.
    pub subresource: String,
    /// CREATE, UPDATE, DELETE or CONNECT.
    pub operation: String,
    /// The object's namespace, or empty.
    pub namespace: String,
    /// The object's name (empty for a CREATE with `generateName`).
    pub name: String,
    /// The object as it would be stored (absent for DELETE).
    pub object: Option<Value>,
    /// The object before the operation (UPDATE, DELETE).
    pub old_object: Option<Value>,
    /// A dry run: nothing will be stored.
    pub dry_run: bool,
    /// The requesting user.
    pub user_info: Option<Value>,
    /// The headers of the HTTP request that carried the review ([`headers`]); not part of
    /// the document.
    pub headers: Vec<(String, String)>,
}

impl Review {
    /// The body the handlers see: the new object, or the old one for DELETE.
    pub fn body(&self) -> Option<&Value> {
        self.object.as_ref().or(self.old_object.as_ref())
    }

    /// `plural[/subresource].group` for logs and metrics.
    pub fn resource_name(&self) -> String {
        let mut s = self.resource.clone();
        if !self.subresource.is_empty() {
            s.push('/');
            s.push_str(&self.subresource);
        }
        if !self.group.is_empty() {
            s.push('.');
            s.push_str(&self.group);
        }
        s
    }

    /// `namespace/name` (or `name`) for logs.
    pub fn object_name(&self) -> String {
        let name = if self.name.is_empty() {
            self.body()
                .and_then(|b| b.pointer("/metadata/generateName"))
                .and_then(Value::as_str)
                .map_or_else(String::new, |g| format!("{g}*"))
        } else {
            self.name.clone()
        };
        if self.namespace.is_empty() {
            name
        } else {
            format!("{}/{name}", self.namespace)
        }
    }
}

/// The deepest nesting of arrays and objects accepted in a review document (serde_json's own
/// recursion limit, checked on the raw bytes so that nothing is built for a deeper one).
pub const MAX_DEPTH: usize = 128;

/// What a scan of the raw bytes tells before anything is parsed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// The deepest nesting of arrays and objects.
    pub depth: usize,
    /// About how many JSON values the document holds (opening brackets, commas and colons outside
    /// strings): what a tree of it costs is proportional to this.
    pub values: usize,
}

/// Scans `body` without parsing it.
///
/// # Errors
/// When the nesting is deeper than [`MAX_DEPTH`] (the text of the HTTP 400 answer).
pub fn shape(body: &[u8]) -> Result<Shape, String> {
    let (mut depth, mut deepest, mut values) = (0usize, 0usize, 1usize);
    let (mut in_string, mut escaped) = (false, false);
    for &b in body {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                values += 1;
                if depth > MAX_DEPTH {
                    return Err(format!("the document is nested deeper than {MAX_DEPTH} levels"));
                }
                deepest = deepest.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            b',' | b':' => values += 1,
            _ => {}
        }
    }
    Ok(Shape {
        depth: deepest,
        values,
    })
}

/// An object in a review (`object`, `oldObject`), kept as the JSON text it arrived as until
/// the handlers need its tree; only its metadata is read on arrival.
#[derive(Clone, Debug)]
pub struct RawObject {
    json: Box<RawValue>,
    meta: ObjectMeta,
}

impl RawObject {
    /// The object's tree.
    ///
    /// # Errors
    /// When the text is not JSON (it was, when it arrived).
    pub fn tree(&self) -> Result<Value, serde_json::Error> {
        serde_json::from_str(self.json.get())
    }
}

impl<'de> Deserialize<'de> for RawObject {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        /// The only part of an object read on arrival; the rest is skipped, not built.
        #[derive(Deserialize)]
        struct Head {
            #[serde(default)]
            metadata: ObjectMeta,
        }
        let json = Box::<RawValue>::deserialize(deserializer)?;
        let head: Head = serde_json::from_str(json.get())
            .map_err(|e| serde::de::Error::custom(format!("the object is not a Kubernetes object: {e}")))?;
        Ok(Self {
            json,
            meta: head.metadata,
        })
    }
}

impl Serialize for RawObject {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.json.serialize(serializer)
    }
}

impl Resource for RawObject {
    type DynamicType = ApiResource;
    type Scope = DynamicResourceScope;

    fn kind(dt: &ApiResource) -> Cow<'_, str> {
        Cow::Borrowed(&dt.kind)
    }

    fn group(dt: &ApiResource) -> Cow<'_, str> {
        Cow::Borrowed(&dt.group)
    }

    fn version(dt: &ApiResource) -> Cow<'_, str> {
        Cow::Borrowed(&dt.version)
    }

    fn plural(dt: &ApiResource) -> Cow<'_, str> {
        Cow::Borrowed(&dt.plural)
    }

    fn meta(&self) -> &ObjectMeta {
        &self.meta
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.meta
    }
}

/// The outside of the document, read first: the request stays raw text until the version and
/// kind are known.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Envelope<'a> {
    #[serde(default)]
    api_version: String,
    #[serde(default)]
    kind: String,
    #[serde(borrow)]
    request: Option<&'a RawValue>,
}

/// Reads an `AdmissionReview` request into kube's typed review (objects kept as text), checks
/// it, and builds the trees the handlers need. Call [`shape`] first: the document is not
/// scanned for depth again.
///
/// # Errors
/// Why the document is not one (the text of the HTTP 400 answer).
pub fn parse(body: &[u8]) -> Result<Review, String> {
    let envelope: Envelope<'_> =
        serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
    if envelope.api_version.is_empty() {
        return Err("apiVersion is missing".into());
    }
    if !matches!(
        envelope.api_version.as_str(),
        "admission.k8s.io/v1" | "admission.k8s.io/v1beta1"
    ) {
        return Err(format!(
            "apiVersion {:?} is not admission.k8s.io/v1 or v1beta1",
            envelope.api_version
        ));
    }
    if envelope.kind != "AdmissionReview" {
        return Err("kind is not AdmissionReview".into());
    }
    let raw = envelope
        .request
        .filter(|r| r.get().starts_with('{'))
        .ok_or("request is missing")?;
    let request: AdmissionRequest<RawObject> =
        serde_json::from_str(raw.get()).map_err(|e| format!("request: {e}"))?;
    let typed = AdmissionReview {
        types: TypeMeta {
            api_version: envelope.api_version,
            kind: envelope.kind,
        },
        request: Some(request),
        response: None,
    };
    Review::from_typed(typed)
}

impl Review {
    /// The review the handlers see, from kube's typed one.
    ///
    /// # Errors
    /// Why the request is refused.
    pub fn from_typed(typed: AdmissionReview<RawObject>) -> Result<Self, String> {
        let api_version = typed.types.api_version.clone();
        let request: AdmissionRequest<RawObject> =
            typed.try_into().map_err(|_| "request is missing".to_owned())?;
        if request.uid.is_empty() || request.uid.len() > MAX_UID {
            return Err("request.uid is missing or too long".into());
        }
        if request.resource.resource.is_empty() {
            return Err("request.resource.resource is missing".into());
        }
        let tree = |o: Option<&RawObject>| -> Result<Option<Value>, String> {
            match o.map(RawObject::tree).transpose() {
                Ok(Some(v)) if !v.is_object() => Err("request.object is not a JSON object".into()),
                Ok(v) => Ok(v),
                Err(e) => Err(format!("request.object: {e}")),
            }
        };
        let object = tree(request.object.as_ref())?;
        let old_object = tree(request.old_object.as_ref())?;
        let user_info = serde_json::to_value(&request.user_info).ok();
        Ok(Self {
            api_version,
            uid: request.uid,
            group: request.resource.group,
            version: request.resource.version,
            resource: request.resource.resource,
            subresource: request.sub_resource.unwrap_or_default(),
            operation: match request.operation {
                Operation::Create => "CREATE",
                Operation::Update => "UPDATE",
                Operation::Delete => "DELETE",
                Operation::Connect => "CONNECT",
            }
            .to_owned(),
            namespace: request.namespace.unwrap_or_default(),
            name: request.name,
            object,
            old_object,
            dry_run: request.dry_run,
            user_info,
            headers: Vec::new(),
        })
    }
}

/// The headers of a review's HTTP request as kopf hands them to its handlers: each name in
/// its canonical form (`User-Agent`: HTTP/1 names are case-insensitive, hyper keeps them in
/// lower case, and the API server's Go client sends them canonical), the values of a repeated
/// name joined with ", ", values that are not text left out. Bounded by the server's header
/// limits.
pub fn headers(map: &http::HeaderMap) -> Vec<(String, String)> {
    map.keys()
        .filter_map(|name| {
            let values: Vec<&str> = map.get_all(name).iter().filter_map(|v| v.to_str().ok()).collect();
            (!values.is_empty()).then(|| (canonical(name.as_str()), values.join(", ")))
        })
        .collect()
}

/// `content-type` → `Content-Type`.
fn canonical(name: &str) -> String {
    name.split('-')
        .map(|part| {
            let mut chars = part.chars();
            chars.next().map_or_else(String::new, |first| {
                first.to_ascii_uppercase().to_string() + &chars.as_str().to_ascii_lowercase()
            })
        })
        .collect::<Vec<_>>()
        .join("-")
}

/// The answer to one review.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Verdict {
    /// Admitted.
    pub allowed: bool,
    /// The HTTP code of a denial.
    pub code: u16,
    /// The message of a denial.
    pub message: String,
    /// A JSON Patch (an array of operations) for the object; `None` when nothing changes.
    pub patch: Option<Value>,
    /// Warnings for the client.
    pub warnings: Vec<String>,
}

impl Verdict {
    /// Admitted without changes.
    pub fn allow() -> Self {
        Self {
            allowed: true,
            ..Self::default()
        }
    }

    /// Denied with `message` and HTTP `code`.
    pub fn deny(code: u16, message: impl Into<String>) -> Self {
        Self {
            allowed: false,
            code,
            message: cut(message.into(), MAX_MESSAGE_BYTES),
            ..Self::default()
        }
    }

    /// Adds a warning, within the bounds.
    pub fn warn(&mut self, warning: impl Into<String>) {
        match self.warnings.len() {
            n if n < MAX_WARNINGS - 1 => self.warnings.push(cut(warning.into(), MAX_WARNING_BYTES)),
            n if n == MAX_WARNINGS - 1 => self.warnings.push("further warnings were dropped".into()),
            _ => {}
        }
    }
}

/// The response document for `review`.
pub fn render(review: &Review, verdict: &Verdict) -> Vec<u8> {
    let mut response = json!({"uid": review.uid, "allowed": verdict.allowed});
    if !verdict.allowed {
        response["status"] = json!({
            "code": verdict.code,
            "message": verdict.message,
            "reason": reason(verdict.code),
        });
    }
    if let Some(patch) = verdict.patch.as_ref().filter(|_| verdict.allowed) {
        let bytes = serde_json::to_vec(patch).unwrap_or_default();
        response["patchType"] = json!("JSONPatch");
        response["patch"] = serde_json::to_value(k8s_openapi::ByteString(bytes)).unwrap_or_default();
    }
    if !verdict.warnings.is_empty() {
        response["warnings"] = json!(verdict.warnings);
    }
    serde_json::to_vec(&json!({
        "apiVersion": review.api_version,
        "kind": "AdmissionReview",
        "response": response,
    }))
    .unwrap_or_default()
}

/// The `metav1.Status` reason of an HTTP code.
fn reason(code: u16) -> &'static str {
    match code {
        400 => "BadRequest",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "NotFound",
        409 => "Conflict",
        422 => "Invalid",
        429 => "TooManyRequests",
        504 => "Timeout",
        _ => "",
    }
}

/// `s` cut to at most `max` bytes at a character boundary.
pub fn cut(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_come_with_canonical_names_and_repeats_joined() {
        let mut map = http::HeaderMap::new();
        map.insert(
            "user-agent",
            http::HeaderValue::from_static("kube-apiserver-admission"),
        );
        map.insert("content-type", http::HeaderValue::from_static("application/json"));
        map.append("x-forwarded-for", http::HeaderValue::from_static("10.0.0.1"));
        map.append("x-forwarded-for", http::HeaderValue::from_static("10.0.0.2"));
        map.insert(
            "x-binary",
            http::HeaderValue::from_bytes(b"\xff").expect("a value"),
        );
        let mut headers = headers(&map);
        headers.sort();
        assert_eq!(
            headers,
            [
                ("Content-Type", "application/json"),
                ("User-Agent", "kube-apiserver-admission"),
                ("X-Forwarded-For", "10.0.0.1, 10.0.0.2"),
            ]
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
        );
    }

    fn request() -> Value {
        json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "u-1",
                "kind": {"group": "demo.capstan.dev", "version": "v1", "kind": "Example"},
                "resource": {"group": "demo.capstan.dev", "version": "v1", "resource": "examples"},
                "namespace": "default",
                "name": "one",
                "operation": "CREATE",
                "userInfo": {"username": "admin"},
                "object": {"metadata": {"name": "one"}, "spec": {}},
                "oldObject": null,
                "dryRun": true
            }
        })
    }

    #[test]
    fn reads_a_review() {
        let review = parse(&serde_json::to_vec(&request()).expect("json")).expect("valid");
        assert_eq!(review.uid, "u-1");
        assert_eq!(review.resource_name(), "examples.demo.capstan.dev");
        assert_eq!(review.object_name(), "default/one");
        assert!(review.dry_run);
        assert!(review.old_object.is_none());
    }

    #[test]
    fn says_why_a_review_is_refused() {
        for (change, why) in [
            (json!({"kind": "Pod"}), "kind is not AdmissionReview"),
            (json!({"apiVersion": "v1"}), "is not admission.k8s.io"),
            (json!({"request": {"uid": ""}}), "request.uid"),
            (
                json!({"request": {"operation": "PATCH"}}),
                "unknown variant `PATCH`",
            ),
            (json!({"request": {"resource": null}}), "missing field `resource`"),
            (json!({"request": {"object": [1]}}), "not a Kubernetes object"),
            (json!({"request": {"userInfo": null}}), "missing field `userInfo`"),
        ] {
            let mut doc = request();
            json_patch::merge(&mut doc, &change);
            let err = parse(&serde_json::to_vec(&doc).expect("json")).expect_err("refused");
            assert!(err.contains(why), "{err} / {why}");
        }
        assert!(parse(b"{not json").expect_err("refused").contains("not JSON"));
    }

    #[test]
    fn the_raw_scan_refuses_deep_documents_and_counts_values() {
        let deep = format!("{}{}", "[".repeat(MAX_DEPTH + 1), "]".repeat(MAX_DEPTH + 1));
        assert!(
            shape(deep.as_bytes())
                .expect_err("too deep")
                .contains("deeper than 128")
        );
        let fine = format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        assert_eq!(shape(fine.as_bytes()).map(|s| s.depth), Ok(MAX_DEPTH));
        // Brackets, commas and colons inside strings are text.
        let text = br#"{"a":"[[[,,,:\"{{","b":[0,0,0]}"#;
        assert_eq!(shape(text), Ok(Shape { depth: 2, values: 8 }));
        let review = serde_json::to_vec(&request()).expect("json");
        assert!(parse(&review).is_ok());
    }

    #[test]
    fn renders_denials_patches_and_warnings() {
        let review = parse(&serde_json::to_vec(&request()).expect("json")).expect("valid");
        let mut verdict = Verdict::allow();
        verdict.patch = Some(json!([{"op": "add", "path": "/spec/x", "value": 1}]));
        for i in 0..40 {
            verdict.warn(format!("w{i}"));
        }
        let doc: Value = serde_json::from_slice(&render(&review, &verdict)).expect("json");
        assert_eq!(doc["response"]["uid"], "u-1");
        assert_eq!(doc["response"]["patchType"], "JSONPatch");
        let patch: k8s_openapi::ByteString =
            serde_json::from_value(doc["response"]["patch"].clone()).expect("base64");
        assert_eq!(
            serde_json::from_slice::<Value>(&patch.0).expect("json"),
            json!([{"op": "add", "path": "/spec/x", "value": 1}])
        );
        assert_eq!(
            doc["response"]["warnings"].as_array().map(Vec::len),
            Some(MAX_WARNINGS)
        );
        let denied = Verdict::deny(403, "x".repeat(10_000));
        let doc: Value = serde_json::from_slice(&render(&review, &denied)).expect("json");
        assert_eq!(doc["response"]["allowed"], false);
        assert_eq!(doc["response"]["status"]["code"], 403);
        assert_eq!(
            doc["response"]["status"]["message"].as_str().map(str::len),
            Some(MAX_MESSAGE_BYTES)
        );
        assert!(doc["response"].get("patch").is_none());
    }
}
