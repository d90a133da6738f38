//! The pages' files, embedded in the binary with `include_str!`: one HTML shell for every page, a stylesheet
//! and a script. Plain files, no build step: edit them and rebuild kmqd. The script draws the page the URL's
//! path names from the JSON API, and asks again every second.

/// The shell; `{{csrf}}` and `{{read_only}}` are filled in per process.
const INDEX: &str = include_str!("assets/index.html");
const CSS: &str = include_str!("assets/app.css");
const JS: &str = include_str!("assets/app.js");

/// The page shell with this process's CSRF token and read-only flag in its `<meta>` tags.
pub fn page(csrf: &str, read_only: bool) -> String {
    INDEX
        .replace("{{csrf}}", csrf)
        .replace("{{read_only}}", if read_only { "true" } else { "false" })
}

/// `/assets/NAME`: its content type and text.
pub fn file(name: &str) -> Option<(&'static str, &'static str)> {
    match name {
        "app.css" => Some(("text/css; charset=utf-8", CSS)),
        "app.js" => Some(("text/javascript; charset=utf-8", JS)),
        _ => None,
    }
}
