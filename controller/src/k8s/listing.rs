//! Paged LISTs whose objects stay text until they are taken, one at a time.
//!
//! Why not `Api::list`: it parses a whole page (500 objects by default) into `DynamicObject`s
//! at once, and a parsed object takes several times the size of its JSON. Listings run when
//! the controller is busiest — the watch's initial listing at start-up and the listing of
//! marked objects ([`crate::engine::queue`]) while every worker is taken — and a parsed page
//! was the largest single item of the start-up peak. Here a page's answer is read into one
//! buffer as it arrives (the transport's chunks are freed as they are copied in, where
//! `Client::request_text` collects them and then copies the whole twice), its objects are
//! located in it without copying, and each is parsed only when the caller takes it. The page's
//! text stays until its last object is taken. An object that does not parse fails alone (see
//! [`super::quarantine`]): the page's others are taken as ever.

use std::{ops::Range, time::Duration};

use futures::AsyncBufReadExt as _;

use kube::{
    Api,
    api::{DynamicObject, ListParams},
};
use serde::Deserialize;
use serde_json::value::RawValue;

use super::quarantine::Unparsed;

/// The parameters of a paged LIST with a watch's server-side selectors.
pub fn list_params(page_size: u32, label_selector: Option<&str>, field_selector: Option<&str>) -> ListParams {
    let mut params = ListParams::default().limit(page_size);
    if let Some(l) = label_selector {
        params = params.labels(l);
    }
    if let Some(f) = field_selector {
        params = params.fields(f);
    }
    params
}

/// Adds KEP-5866's `shardSelector` to a LIST or WATCH request: the server returns only the
/// objects whose uid hashes into the selector's ranges (where the `ShardedListAndWatch`
/// feature is on; others ignore the parameter, and the caller filters on arrival).
pub fn with_shard_selector<B>(request: &mut http::Request<B>, selector: Option<&str>) {
    let Some(selector) = selector else {
        return;
    };
    let uri = request.uri().to_string();
    let separator = if uri.contains('?') { '&' } else { '?' };
    let mut encoded = String::with_capacity(selector.len() * 2);
    for b in selector.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            encoded.push(char::from(b));
        } else {
            encoded.push_str(&format!("%{b:02X}"));
        }
    }
    if let Ok(with) = format!("{uri}{separator}shardSelector={encoded}").parse() {
        *request.uri_mut() = with;
    }
}

/// A LIST answer's metadata, with KEP-5866's `shardInfo`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ListMeta {
    resource_version: Option<String>,
    #[serde(rename = "continue")]
    continue_: Option<String>,
    shard_info: Option<serde::de::IgnoredAny>,
}

/// One page of a LIST: its list metadata, and its objects as text.
#[derive(Debug)]
pub struct Page {
    /// The list's resourceVersion, when the server gave one.
    pub resource_version: Option<String>,
    /// The token of the next page; `None` on the last page.
    pub continue_token: Option<String>,
    /// Whether the server applied a shard selector (it echoed `shardInfo`).
    pub sharded: bool,
    /// The answer as it came.
    text: Vec<u8>,
    /// Where each object is in `text`.
    items: Vec<Range<usize>>,
}

impl Page {
    /// Splits a LIST answer into its metadata and where its objects are.
    fn parse(text: Vec<u8>) -> Result<Self, serde_json::Error> {
        /// `items` must be there (an answer without is no list), but may be `null`.
        fn null_as_empty<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<&'de RawValue>, D::Error> {
            Ok(Option::<Vec<&'de RawValue>>::deserialize(d)?.unwrap_or_default())
        }
        #[derive(Deserialize)]
        struct Wire<'a> {
            #[serde(default)]
            metadata: ListMeta,
            #[serde(borrow, deserialize_with = "null_as_empty")]
            items: Vec<&'a RawValue>,
        }
        let wire: Wire<'_> = serde_json::from_slice(&text)?;
        // Each object's text borrows from `text`: its place there is its offset from the start.
        let start = text.as_ptr().addr();
        let items = wire
            .items
            .iter()
            .map(|raw| {
                let at = raw.get().as_ptr().addr() - start;
                at..at + raw.get().len()
            })
            .collect();
        Ok(Self {
            resource_version: wire.metadata.resource_version,
            continue_token: wire.metadata.continue_.filter(|c| !c.is_empty()),
            sharded: wire.metadata.shard_info.is_some(),
            text,
            items,
        })
    }

    /// How many objects the page holds.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether the page holds no objects.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The page's objects in order, each parsed when taken (the page's text is freed when the
    /// last is taken); one that does not parse is [`Unparsed`], to be quarantined.
    pub fn objects(self) -> impl Iterator<Item = Result<DynamicObject, Unparsed>> {
        let Self { text, items, .. } = self;
        items.into_iter().map(move |at| {
            let object = text
                .get(at)
                .and_then(|o| std::str::from_utf8(o).ok())
                .unwrap_or_default();
            serde_json::from_str(object).map_err(|e| Unparsed::new(object, e))
        })
    }
}

/// Reads an answer's body into one buffer as it arrives.
async fn read_all(mut body: impl futures::AsyncBufRead + Unpin) -> std::io::Result<Vec<u8>> {
    let mut text = Vec::new();
    loop {
        let chunk = body.fill_buf().await?;
        if chunk.is_empty() {
            // Growing by doubling left up to as much room again as the answer.
            text.shrink_to_fit();
            return Ok(text);
        }
        let n = chunk.len();
        text.extend_from_slice(chunk);
        body.consume_unpin(n);
    }
}

/// One page of a LIST (with `shard`, a shard selector), failing as timed out when it takes
/// longer than `timeout`.
///
/// # Errors
/// The API's answer as [`kube::Error::Api`] (410 Gone for an expired continue token), a
/// transport error, a timeout, or [`kube::Error::SerdeError`] for an answer that is no list.
pub async fn list_page(
    api: &Api<DynamicObject>,
    params: &ListParams,
    shard: Option<&str>,
    timeout: Duration,
) -> Result<Page, kube::Error> {
    let mut request = kube::core::Request::new(api.resource_url())
        .list(params)
        .map_err(kube::Error::BuildRequest)?;
    with_shard_selector(&mut request, shard);
    request.extensions_mut().insert("list");
    let client = api.clone().into_client();
    let answer = async {
        let body = client.request_stream(request).await?;
        read_all(body)
            .await
            .map_err(|e| kube::Error::Service(Box::new(e)))
    };
    let text = match tokio::time::timeout(timeout, answer).await {
        Ok(text) => text?,
        Err(_) => {
            return Err(kube::Error::Service(Box::new(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("listing hung for {timeout:?}"),
            ))));
        }
    };
    Page::parse(text).map_err(kube::Error::SerdeError)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_keeps_its_metadata_and_yields_its_objects_in_order() {
        let text = r#"{"apiVersion":"v1","kind":"List","metadata":{"resourceVersion":"42","continue":"next"},
            "items":[{"apiVersion":"demo.capstan.dev/v1","kind":"Example","metadata":{"name":"a","uid":"u1"},"spec":{"x":1}},
                     {"apiVersion":"demo.capstan.dev/v1","kind":"Example","metadata":{"name":"b","uid":"u2"}}]}"#;
        let page = Page::parse(text.into()).unwrap();
        assert_eq!(page.resource_version.as_deref(), Some("42"));
        assert_eq!(page.continue_token.as_deref(), Some("next"));
        assert_eq!(page.len(), 2);
        let objects: Vec<DynamicObject> = page.objects().collect::<Result<_, _>>().unwrap();
        assert_eq!(objects[0].metadata.uid.as_deref(), Some("u1"));
        assert_eq!(objects[0].data["spec"]["x"], 1);
        assert_eq!(objects[1].metadata.name.as_deref(), Some("b"));
    }

    #[test]
    fn a_page_says_whether_the_server_applied_a_shard_selector() {
        let plain =
            Page::parse(br#"{"metadata":{"resourceVersion":"5"},"items":[]}"#.to_vec()).expect("a page");
        assert!(!plain.sharded);
        let sharded = Page::parse(
            br#"{"metadata":{"resourceVersion":"5","shardInfo":{"selector":"shardRange(object.metadata.uid, '0x0000000000000000', '0x8000000000000000')"}},"items":[]}"#.to_vec(),
        )
        .expect("a page");
        assert!(sharded.sharded);
    }

    #[test]
    fn shard_selectors_are_added_to_the_query_encoded() {
        let mut request = http::Request::get("/apis/demo/v1/examples?limit=500")
            .body(())
            .expect("a request");
        with_shard_selector(
            &mut request,
            Some("shardRange(object.metadata.uid, '0x0000000000000000', '0x8000000000000000') || x"),
        );
        assert_eq!(
            request.uri().query(),
            Some(
                "limit=500&shardSelector=shardRange%28object.metadata.uid%2C%20%270x0000000000000000%27%2C%20%270x8000000000000000%27%29%20%7C%7C%20x"
            )
        );
        let mut bare = http::Request::get("/api/v1/configmaps")
            .body(())
            .expect("a request");
        with_shard_selector(&mut bare, None);
        assert_eq!(bare.uri().query(), None);
    }

    #[test]
    fn the_last_page_has_no_continue_token_and_null_items_are_no_objects() {
        let page = Page::parse(r#"{"metadata":{"continue":""},"items":null}"#.into()).unwrap();
        assert_eq!(page.continue_token, None);
        assert!(page.is_empty());
        let page = Page::parse(r#"{"metadata":{},"items":[]}"#.into()).unwrap();
        assert!(page.is_empty() && page.resource_version.is_none());
    }

    #[test]
    fn an_object_that_is_not_one_fails_when_taken() {
        let page = Page::parse(
            r#"{"metadata":{},"items":[{"metadata":{"name":"a"}},{"metadata":"nonsense"}]}"#.into(),
        )
        .unwrap();
        let taken: Vec<_> = page.objects().collect();
        assert!(taken[0].is_ok());
        assert!(taken[1].is_err());
        assert!(taken.len() == 2);
    }

    #[test]
    fn an_object_nested_deeper_than_the_parser_allows_fails_alone() {
        let deep = format!("{}1{}", "[".repeat(200), "]".repeat(200));
        let text = format!(
            r#"{{"metadata":{{"resourceVersion":"9"}},"items":[{{"metadata":{{"name":"a"}}}},
               {{"metadata":{{"name":"deep","uid":"u-deep"}},"spec":{deep}}},{{"metadata":{{"name":"b"}}}}]}}"#
        );
        let page = Page::parse(text.into_bytes()).unwrap();
        let taken: Vec<_> = page.objects().collect();
        assert_eq!(taken.len(), 3);
        let unparsed = taken[1].as_ref().expect_err("too deep");
        assert_eq!(unparsed.identity.uid, "u-deep");
        let names: Vec<_> = taken
            .iter()
            .filter_map(|o| o.as_ref().ok())
            .filter_map(|o| o.metadata.name.clone())
            .collect();
        assert_eq!(names, ["a", "b"]);
    }

    #[tokio::test]
    async fn an_answer_that_arrives_in_small_chunks_is_read_whole() {
        let text = r#"{"metadata":{"resourceVersion":"7"},"items":[{"metadata":{"name":"a"}},{"metadata":{"name":"b"}}]}"#;
        let body =
            futures::io::BufReader::with_capacity(3, futures::io::Cursor::new(text.as_bytes().to_vec()));
        let read = read_all(body).await.unwrap();
        assert_eq!(read, text.as_bytes());
        let page = Page::parse(read).unwrap();
        let names: Vec<_> = page
            .objects()
            .map(|o| o.unwrap().metadata.name.unwrap())
            .collect();
        assert_eq!(names, ["a", "b"]);
    }

    #[test]
    fn an_answer_that_is_no_list_is_an_error() {
        assert!(Page::parse(b"[1,2]".to_vec()).is_err());
        // Without `items` an answer is no list, even an empty one or a Status: taking it for an
        // empty last page would make every known object look deleted.
        assert!(Page::parse(b"{}".to_vec()).is_err());
        assert!(
            Page::parse(r#"{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Success"}"#.into())
                .is_err()
        );
    }
}
