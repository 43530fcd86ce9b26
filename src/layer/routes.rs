//! Pricing by route: a table keyed by method and axum's matched path.

use std::fmt;
use std::sync::Arc;

use axum::extract::MatchedPath;
use http::Method;
use http::request::Parts;
use rustc_hash::FxHashMap;

use super::config::Price;

/// Prices requests by method and route template, for
/// [`TollgateBuilder::price`](super::TollgateBuilder::price).
///
/// Routes are written as axum writes them (`"/users/{id}"`). For each
/// request the table looks up, in order:
///
/// 1. the [`MatchedPath`] in the request's extensions, when present: the
///    template of the route axum matched;
/// 2. otherwise the raw URI path, compared exactly (no templates, no
///    trailing-slash or case folding);
/// 3. the fallback price, when neither has an entry for the method.
///
/// # Where the layer runs decides what it sees
///
/// axum inserts [`MatchedPath`] when it routes the request, so the table
/// sees it only if the tollgate layer runs *after* routing: added with
/// `Router::route_layer`, or with `Router::layer` (which axum applies to
/// each route, behind the router's matching). A layer wrapped around the
/// whole router from outside (`TollgateLayer::layer(router)`, a
/// `tower::ServiceBuilder` over the router, a layer on a service mounted
/// with `nest_service`) runs *before* routing: there is no
/// [`MatchedPath`], so a templated entry never matches and only entries
/// equal to the raw path do; everything else gets the fallback. Requests
/// no route matches (the router's fallback) have no [`MatchedPath`]
/// either.
///
/// Under `Router::nest`, axum matches (and names in [`MatchedPath`]) the
/// whole template, prefix included: a route `"/users/{id}"` of a router
/// nested at `"/api"` is priced by an entry for `"/api/users/{id}"`.
///
/// Methods match exactly, except that a `HEAD` request with no entry of its
/// own takes the `GET` entry: axum serves `HEAD` with the `GET` handler, so
/// it does the same work and needs the same permissions.
///
/// ```no_run
/// # fn example(handle: tollgate::runtime::RuntimeHandle) {
/// use http::Method;
/// use tollgate::layer::{Price, RouteTable, TollgateLayer};
/// use tollgate::{CostUnits, PermissionBits};
///
/// let price = |units| Price { units: CostUnits(units), required: PermissionBits::NONE };
/// let table = RouteTable::new(price(1))
///     .route(Method::GET, "/users/{id}", price(2))
///     .route(Method::POST, "/users", price(10));
/// let layer = TollgateLayer::builder(handle)
///     .price(table.pricer())
///     .build()
///     .expect("pricing was given");
/// // Add it with `Router::route_layer(layer)` so the matched path is known.
/// # let _ = layer;
/// # }
/// ```
#[derive(Clone)]
#[must_use]
pub struct RouteTable {
    fallback: Price,
    /// Path (template or raw) to the prices of its methods.
    routes: FxHashMap<String, Vec<(Method, Price)>>,
}

impl RouteTable {
    /// An empty table: every request gets `fallback` until routes are
    /// added.
    pub fn new(fallback: Price) -> Self {
        Self {
            fallback,
            routes: FxHashMap::default(),
        }
    }

    /// Prices `method path` at `price`, replacing an earlier entry for the
    /// same method and path. `path` is an axum route template
    /// (`"/users/{id}"`) or a literal path.
    pub fn route(mut self, method: Method, path: impl Into<String>, price: Price) -> Self {
        let methods = self.routes.entry(path.into()).or_default();
        match methods.iter_mut().find(|(known, _)| *known == method) {
            Some((_, known)) => *known = price,
            None => methods.push((method, price)),
        }
        self
    }

    /// The fallback price.
    pub fn fallback(&self) -> Price {
        self.fallback
    }

    /// The price of a request: by its matched path if axum has matched,
    /// else by its raw path (a `HEAD` without an entry of its own as the
    /// `GET`), else the fallback.
    pub fn price_of(&self, parts: &Parts) -> Price {
        let path = parts
            .extensions
            .get::<MatchedPath>()
            .map_or_else(|| parts.uri.path(), MatchedPath::as_str);
        self.lookup(&parts.method, path)
            .or_else(|| {
                (parts.method == Method::HEAD)
                    .then(|| self.lookup(&Method::GET, path))
                    .flatten()
            })
            .unwrap_or(self.fallback)
    }

    /// The entry for exactly `method path`, if there is one.
    pub fn lookup(&self, method: &Method, path: &str) -> Option<Price> {
        self.routes
            .get(path)?
            .iter()
            .find(|(known, _)| known == method)
            .map(|(_, price)| *price)
    }

    /// The table as a pricing function for
    /// [`TollgateBuilder::price`](super::TollgateBuilder::price).
    pub fn pricer(self) -> impl Fn(&Parts) -> Price + Send + Sync + Clone + 'static {
        let table = Arc::new(self);
        move |parts: &Parts| table.price_of(parts)
    }
}

impl fmt::Debug for RouteTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut routes: Vec<_> = self
            .routes
            .iter()
            .flat_map(|(path, methods)| {
                methods
                    .iter()
                    .map(move |(method, price)| (method.as_str(), path.as_str(), price))
            })
            .collect();
        routes.sort_unstable_by(|a, b| (a.1, a.0).cmp(&(b.1, b.0)));
        f.debug_struct("RouteTable")
            .field("fallback", &self.fallback)
            .field("routes", &routes)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CostUnits, PermissionBits};

    fn price(units: u64) -> Price {
        Price {
            units: CostUnits(units),
            required: PermissionBits::NONE,
        }
    }

    fn table() -> RouteTable {
        RouteTable::new(price(1))
            .route(Method::GET, "/users/{id}", price(2))
            .route(Method::POST, "/users/{id}", price(5))
            .route(Method::GET, "/health", price(0))
    }

    fn parts(method: Method, path: &str, matched: Option<&str>) -> Parts {
        let mut request = http::Request::builder()
            .method(method)
            .uri(path)
            .body(())
            .unwrap();
        if let Some(matched) = matched {
            // `MatchedPath` has no public constructor: let axum insert it.
            request.extensions_mut().insert(matched_path(matched, path));
        }
        request.into_parts().0
    }

    /// The `MatchedPath` axum inserts when `template` matches `path`.
    fn matched_path(template: &str, path: &str) -> MatchedPath {
        use axum::Router;
        use axum::routing::any;

        let (sender, receiver) = std::sync::mpsc::channel();
        let mut router: Router = Router::new().route(
            template,
            any(move |matched: MatchedPath| async move {
                sender.send(matched).unwrap();
            }),
        );
        serve_once(&mut router, path);
        receiver.recv().unwrap()
    }

    /// Sends one empty request for `uri` through `service`, to completion.
    fn serve_once<S>(service: &mut S, uri: &str)
    where
        S: tower_service::Service<http::Request<axum::body::Body>>,
        S::Error: std::fmt::Debug,
    {
        let request = http::Request::builder()
            .uri(uri)
            .body(axum::body::Body::empty())
            .unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        runtime.block_on(service.call(request)).unwrap();
    }

    /// A request mapper that sends what `table` prices each request at.
    fn recorder(
        table: RouteTable,
    ) -> (
        impl Fn(http::Request<axum::body::Body>) -> http::Request<axum::body::Body> + Clone,
        std::sync::mpsc::Receiver<Price>,
    ) {
        let (sender, receiver) = std::sync::mpsc::channel();
        let record = move |request: http::Request<axum::body::Body>| {
            let (parts, body) = request.into_parts();
            sender.send(table.price_of(&parts)).unwrap();
            http::Request::from_parts(parts, body)
        };
        (record, receiver)
    }

    #[test]
    fn a_matched_path_is_priced_by_its_template_and_method() {
        let table = table();
        let get = parts(Method::GET, "/users/42", Some("/users/{id}"));
        assert_eq!(table.price_of(&get), price(2));
        let post = parts(Method::POST, "/users/7", Some("/users/{id}"));
        assert_eq!(table.price_of(&post), price(5));
        let delete = parts(Method::DELETE, "/users/7", Some("/users/{id}"));
        assert_eq!(table.price_of(&delete), price(1), "no entry for DELETE");
    }

    #[test]
    fn without_a_matched_path_the_raw_path_is_compared_exactly() {
        let table = table();
        assert_eq!(
            table.price_of(&parts(Method::GET, "/health", None)),
            price(0)
        );
        assert_eq!(
            table.price_of(&parts(Method::GET, "/health?verbose=1", None)),
            price(0),
            "the query is not part of the path"
        );
        assert_eq!(
            table.price_of(&parts(Method::GET, "/health/", None)),
            price(1),
            "no trailing-slash folding"
        );
        assert_eq!(
            table.price_of(&parts(Method::GET, "/users/42", None)),
            price(1),
            "a template never matches a raw path"
        );
        assert_eq!(
            table.price_of(&parts(Method::GET, "/users/{id}", None)),
            price(2),
            "a raw path equal to the template matches it literally"
        );
    }

    #[test]
    fn unknown_routes_and_methods_take_the_fallback() {
        let table = table();
        assert_eq!(table.fallback(), price(1));
        assert_eq!(table.price_of(&parts(Method::GET, "/nope", None)), price(1));
        assert_eq!(
            table.price_of(&parts(Method::HEAD, "/health", None)),
            price(0),
            "HEAD runs the GET handler, so it takes the GET entry"
        );
        assert_eq!(
            table.price_of(&parts(Method::HEAD, "/users/42", Some("/users/{id}"))),
            price(2)
        );
        let own = table.clone().route(Method::HEAD, "/health", price(3));
        assert_eq!(
            own.price_of(&parts(Method::HEAD, "/health", None)),
            price(3),
            "an entry of its own comes first"
        );
        assert_eq!(
            table.price_of(&parts(Method::OPTIONS, "/health", None)),
            price(1),
            "other methods match exactly"
        );
        let empty = RouteTable::new(price(9));
        assert_eq!(empty.price_of(&parts(Method::GET, "/", None)), price(9));
    }

    #[test]
    fn a_later_entry_for_the_same_route_replaces_the_earlier() {
        let table = table().route(Method::GET, "/health", price(4));
        assert_eq!(table.lookup(&Method::GET, "/health"), Some(price(4)));
        assert_eq!(table.lookup(&Method::POST, "/health"), None);
    }

    #[test]
    fn the_pricer_is_the_table() {
        let pricer = table().pricer();
        let get = parts(Method::GET, "/users/1", Some("/users/{id}"));
        assert_eq!(pricer(&get), price(2));
        assert_eq!(pricer(&parts(Method::PUT, "/x", None)), price(1));
    }

    /// What the documentation claims: a layer added with `Router::layer`
    /// runs after routing and sees the matched path; one wrapped around
    /// the router does not.
    #[test]
    fn router_layer_sees_the_matched_path_and_an_outer_layer_does_not() {
        use axum::Router;
        use axum::routing::get;
        use tower::util::MapRequestLayer;
        use tower_layer::Layer as _;

        let (record, receiver) = recorder(table());
        let routes = || Router::new().route("/users/{id}", get(|| async {}));

        let mut inside = routes().layer(MapRequestLayer::new(record.clone()));
        serve_once(&mut inside, "/users/42");
        assert_eq!(receiver.recv().unwrap(), price(2), "Router::layer");

        let mut outside = MapRequestLayer::new(record).layer(routes());
        serve_once(&mut outside, "/users/42");
        assert_eq!(
            receiver.recv().unwrap(),
            price(1),
            "wrapped around the router"
        );
    }

    #[test]
    fn a_nested_route_is_priced_by_its_whole_template() {
        use axum::Router;
        use axum::routing::get;
        use tower::util::MapRequestLayer;

        let (record, receiver) = recorder(table().route(Method::GET, "/api/users/{id}", price(7)));
        let inner = Router::new()
            .route("/users/{id}", get(|| async {}))
            .route_layer(MapRequestLayer::new(record));
        let mut router: Router = Router::new().nest("/api", inner);
        serve_once(&mut router, "/api/users/42");
        assert_eq!(receiver.recv().unwrap(), price(7), "prefix included");
    }
}
