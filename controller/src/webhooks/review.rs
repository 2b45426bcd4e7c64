//! `admission.k8s.io` `AdmissionReview` documents: what the API server sends, read strictly
//! enough to answer "400: why" for anything else, and the response it expects back.
//!
//! Both `admission.k8s.io/v1` and `v1beta1` are read; the response carries the request's own
//! `apiVersion`, as the API server requires. The patch of a mutating response is a JSON Patch,
//! base64-encoded in the document.

use serde_json::{Value, json};

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

/// Reads an `AdmissionReview` request.
///
/// # Errors
/// Why the document is not one (the text of the HTTP 400 answer).
pub fn parse(body: &[u8]) -> Result<Review, String> {
    let doc: Value = serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
    let api_version = doc
        .get("apiVersion")
        .and_then(Value::as_str)
        .ok_or("apiVersion is missing")?;
    if !matches!(api_version, "admission.k8s.io/v1" | "admission.k8s.io/v1beta1") {
        return Err(format!(
            "apiVersion {api_version:?} is not admission.k8s.io/v1 or v1beta1"
        ));
    }
    if doc.get("kind").and_then(Value::as_str) != Some("AdmissionReview") {
        return Err("kind is not AdmissionReview".into());
    }
    let request = doc
        .get("request")
        .filter(|r| r.is_object())
        .ok_or("request is missing")?;
    let text = |key: &str| {
        request
            .get(key)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    let uid = text("uid");
    if uid.is_empty() || uid.len() > MAX_UID {
        return Err("request.uid is missing or too long".into());
    }
    let operation = text("operation");
    if !matches!(operation.as_str(), "CREATE" | "UPDATE" | "DELETE" | "CONNECT") {
        return Err(format!(
            "request.operation {operation:?} is not CREATE, UPDATE, DELETE or CONNECT"
        ));
    }
    let resource = request
        .get("resource")
        .filter(|r| r.is_object())
        .ok_or("request.resource is missing")?;
    let field = |key: &str| {
        resource
            .get(key)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    let plural = field("resource");
    if plural.is_empty() {
        return Err("request.resource.resource is missing".into());
    }
    let object = |key: &str| request.get(key).filter(|v| !v.is_null()).cloned();
    let review = Review {
        api_version: api_version.to_owned(),
        uid,
        group: field("group"),
        version: field("version"),
        resource: plural,
        subresource: text("subResource"),
        operation,
        namespace: text("namespace"),
        name: text("name"),
        object: object("object"),
        old_object: object("oldObject"),
        dry_run: request.get("dryRun").and_then(Value::as_bool).unwrap_or(false),
        user_info: object("userInfo"),
    };
    if review.body().is_some_and(|b| !b.is_object()) {
        return Err("request.object is not a JSON object".into());
    }
    Ok(review)
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
            (json!({"request": {"operation": "PATCH"}}), "request.operation"),
            (json!({"request": {"resource": null}}), "request.resource"),
            (json!({"request": {"object": [1]}}), "not a JSON object"),
        ] {
            let mut doc = request();
            json_patch::merge(&mut doc, &change);
            let err = parse(&serde_json::to_vec(&doc).expect("json")).expect_err("refused");
            assert!(err.contains(why), "{err} / {why}");
        }
        assert!(parse(b"{not json").expect_err("refused").contains("not JSON"));
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
