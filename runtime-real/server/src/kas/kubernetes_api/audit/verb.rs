//! A request's verb, read from its method and path as the API server reads them
//! (`get`, `list`, `watch`, `create`, `exec`, `port-forward`, `logs`, ...).

/// The verb of `method` on `path` (its query included).
pub fn of(method: &str, path: &str) -> &'static str {
    let (path, query) = path.split_once('?').unwrap_or((path, ""));
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let rest = match segments.as_slice() {
        ["api", _version, rest @ ..] => rest,
        ["apis", _group, _version, rest @ ..] => rest,
        _ => return plain(method),
    };
    let (watch_path, rest) = match rest {
        ["watch", rest @ ..] => (true, rest),
        rest => (false, rest),
    };
    // `namespaces/NS/...` scopes what follows; `namespaces` and `namespaces/NS` alone are
    // the namespaces themselves.
    let resource = match rest {
        ["namespaces", _ns, scoped @ ..] if !scoped.is_empty() => scoped,
        rest => rest,
    };
    if resource.is_empty() {
        // The group's discovery document.
        return plain(method);
    }
    match resource.get(2).copied() {
        Some("exec") => return "exec",
        Some("attach") => return "attach",
        Some("portforward") => return "port-forward",
        Some("log") => return "logs",
        Some("proxy") => return "proxy",
        _ => {}
    }
    let named = resource.len() >= 2;
    let watch = watch_path
        || query
            .split('&')
            .any(|kv| kv == "watch=true" || kv == "watch=1");
    match method {
        "GET" | "HEAD" if watch => "watch",
        "GET" | "HEAD" if named => "get",
        "GET" | "HEAD" => "list",
        "POST" => "create",
        "PUT" => "update",
        "PATCH" => "patch",
        "DELETE" if named => "delete",
        "DELETE" => "deletecollection",
        _ => other(method),
    }
}

/// The verb of a path outside the resources (`/version`, `/openapi/v2`, discovery).
fn plain(method: &str) -> &'static str {
    match method {
        "GET" | "HEAD" => "get",
        "POST" => "post",
        "PUT" => "put",
        "PATCH" => "patch",
        "DELETE" => "delete",
        _ => other(method),
    }
}

fn other(method: &str) -> &'static str {
    match method {
        "OPTIONS" => "options",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::of;

    #[test]
    fn verbs_are_read_as_the_api_server_reads_them() {
        for (method, path, verb) in [
            ("GET", "/api/v1/pods", "list"),
            ("GET", "/api/v1/namespaces/default/pods", "list"),
            ("GET", "/api/v1/namespaces/default/pods/web", "get"),
            (
                "GET",
                "/api/v1/namespaces/default/pods?watch=true&rv=1",
                "watch",
            ),
            ("GET", "/api/v1/watch/namespaces/default/pods", "watch"),
            ("GET", "/api/v1/namespaces", "list"),
            ("GET", "/api/v1/namespaces/default", "get"),
            ("DELETE", "/api/v1/namespaces/default", "delete"),
            (
                "GET",
                "/api/v1/namespaces/default/pods/web/log?follow=true",
                "logs",
            ),
            (
                "GET",
                "/api/v1/namespaces/default/pods/web/exec?command=ls",
                "exec",
            ),
            (
                "POST",
                "/api/v1/namespaces/default/pods/web/exec?command=ls",
                "exec",
            ),
            (
                "POST",
                "/api/v1/namespaces/default/pods/web/portforward",
                "port-forward",
            ),
            (
                "POST",
                "/api/v1/namespaces/default/pods/web/attach",
                "attach",
            ),
            (
                "GET",
                "/api/v1/namespaces/default/services/web/proxy/x",
                "proxy",
            ),
            (
                "POST",
                "/apis/apps/v1/namespaces/default/deployments",
                "create",
            ),
            (
                "PUT",
                "/apis/apps/v1/namespaces/default/deployments/web",
                "update",
            ),
            (
                "PATCH",
                "/apis/apps/v1/namespaces/default/deployments/web/scale",
                "patch",
            ),
            (
                "DELETE",
                "/apis/apps/v1/namespaces/default/deployments",
                "deletecollection",
            ),
            ("GET", "/apis/apps/v1", "get"),
            ("GET", "/api", "get"),
            ("GET", "/version", "get"),
            ("GET", "/openapi/v2", "get"),
            ("BREW", "/api/v1/pods", "other"),
            ("GET", "", "get"),
        ] {
            assert_eq!(of(method, path), verb, "{method} {path}");
        }
    }
}
