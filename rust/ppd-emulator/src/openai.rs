//! vLLM's checks of a generation request's fields, so a bad request gets vLLM's own status and error.
//!
//! vLLM refuses in two ways: its request model (pydantic) answers a mistyped
//! field with type `Bad Request` and param `body.<field>`; its sampler and
//! validators answer a value out of range with type `BadRequestError`.

use serde_json::{Map, Value};

/// vLLM's default `max_logprobs`: more alternatives per token are refused.
pub(crate) const MAX_LOGPROBS: i64 = 20;
/// vLLM's default `VLLM_MAX_N_SEQUENCES`: the most choices one request may ask for.
pub(crate) const MAX_N: i64 = 16_384;
/// The emulated model's vocabulary (Llama 3): what `logprobs: -1` asks for.
const VOCAB_SIZE: i64 = 128_256;
/// vLLM's `_SAMPLING_EPS`: a temperature below it samples greedily.
const SAMPLING_EPS: f64 = 1e-5;

/// A refusal in vLLM's words: `type` is `Bad Request` (pydantic) or `BadRequestError`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Refusal {
    pub kind: &'static str,
    pub message: String,
    pub param: Option<String>,
}

fn schema(loc: &str, kind: &str, msg: &str, input: &Value) -> Refusal {
    let input = match input {
        Value::String(s) => format!("'{s}'"),
        Value::Object(o) => format!("'<dict of {} items>'", o.len()),
        Value::Array(a) => format!("'<list of {} items>'", a.len()),
        other => other.to_string(),
    };
    Refusal {
        kind: "Bad Request",
        message: format!(
            "1 validation error:\n  {{'type': '{kind}', 'loc': '{loc}', 'msg': '{msg}', 'input': {input}}}"
        ),
        param: Some(loc.to_owned()),
    }
}

fn invalid(message: impl Into<String>, param: Option<&str>) -> Refusal {
    Refusal {
        kind: "BadRequestError",
        message: message.into(),
        param: param.map(str::to_owned),
    }
}

/// The types vLLM's request model gives the fields the emulator reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ty {
    Number,
    Integer,
    Bool,
}

const COMMON: [(&str, Ty); 13] = [
    ("temperature", Ty::Number),
    ("top_p", Ty::Number),
    ("min_p", Ty::Number),
    ("presence_penalty", Ty::Number),
    ("frequency_penalty", Ty::Number),
    ("repetition_penalty", Ty::Number),
    ("top_k", Ty::Integer),
    ("seed", Ty::Integer),
    ("n", Ty::Integer),
    ("max_tokens", Ty::Integer),
    ("min_tokens", Ty::Integer),
    ("stream", Ty::Bool),
    ("ignore_eos", Ty::Bool),
];
const CHAT: [(&str, Ty); 5] = [
    ("max_completion_tokens", Ty::Integer),
    ("top_logprobs", Ty::Integer),
    ("logprobs", Ty::Bool),
    ("add_generation_prompt", Ty::Bool),
    ("continue_final_message", Ty::Bool),
];
const COMPLETION: [(&str, Ty); 2] = [("logprobs", Ty::Integer), ("echo", Ty::Bool)];

/// Pydantic's (lax) verdict on one value; null is "not given" for every field here.
fn type_error(name: &str, ty: Ty, v: &Value) -> Option<Refusal> {
    let loc = format!("body.{name}");
    let parsing = v.is_string();
    match (ty, v) {
        (_, Value::Null) => None,
        (Ty::Number, Value::Number(_)) | (Ty::Bool, Value::Bool(_)) => None,
        (Ty::Integer, Value::Number(n)) => {
            if n.is_i64() || n.is_u64() || n.as_f64().is_some_and(|f| f.fract() == 0.0) {
                None
            } else {
                Some(schema(
                    &loc,
                    "int_from_float",
                    "Input should be a valid integer, got a number with a fractional part",
                    v,
                ))
            }
        }
        (Ty::Number, _) if parsing => Some(schema(
            &loc,
            "float_parsing",
            "Input should be a valid number, unable to parse string as a number",
            v,
        )),
        (Ty::Number, _) => Some(schema(
            &loc,
            "float_type",
            "Input should be a valid number",
            v,
        )),
        (Ty::Integer, _) if parsing => Some(schema(
            &loc,
            "int_parsing",
            "Input should be a valid integer, unable to parse string as an integer",
            v,
        )),
        (Ty::Integer, _) => Some(schema(
            &loc,
            "int_type",
            "Input should be a valid integer",
            v,
        )),
        (Ty::Bool, _) if parsing => Some(schema(
            &loc,
            "bool_parsing",
            "Input should be a valid boolean, unable to interpret input",
            v,
        )),
        (Ty::Bool, _) => Some(schema(
            &loc,
            "bool_type",
            "Input should be a valid boolean",
            v,
        )),
    }
}

/// The body as vLLM's request model reads it: an object, with the fields of their types.
pub(crate) fn check_schema(body: &Value, chat: bool) -> Result<&Map<String, Value>, Refusal> {
    let Some(o) = body.as_object() else {
        return Err(schema(
            "body",
            "model_attributes_type",
            "Input should be a valid dictionary or object to extract fields from",
            body,
        ));
    };
    if chat {
        match o.get("messages") {
            None => return Err(schema("body.messages", "missing", "Field required", body)),
            Some(Value::Array(_)) => {}
            Some(m) => {
                return Err(schema(
                    "body.messages",
                    "list_type",
                    "Input should be a valid list",
                    m,
                ))
            }
        }
    }
    let own: &[(&str, Ty)] = if chat { &CHAT } else { &COMPLETION };
    for (name, ty) in COMMON.iter().chain(own) {
        if let Some(e) = o.get(*name).and_then(|v| type_error(name, *ty, v)) {
            return Err(e);
        }
    }
    Ok(o)
}

fn num(o: &Map<String, Value>, name: &str) -> Option<f64> {
    o.get(name).and_then(Value::as_f64)
}

fn int(o: &Map<String, Value>, name: &str) -> Option<i64> {
    o.get(name).and_then(Value::as_f64).map(|f| f as i64)
}

/// vLLM's request validators, run on the typed body before the model is looked up.
pub(crate) fn check_validators(o: &Map<String, Value>, chat: bool) -> Result<(), Refusal> {
    let stream = o.get("stream").and_then(Value::as_bool) == Some(true);
    if o.get("stream_options").is_some_and(|v| !v.is_null()) && !stream {
        return Err(invalid(
            "Stream options can only be defined when `stream=True`.",
            Some("stream_options"),
        ));
    }
    if chat {
        let flag = |name: &str| o.get(name).and_then(Value::as_bool);
        if flag("continue_final_message") == Some(true)
            && flag("add_generation_prompt").unwrap_or(true)
        {
            // vLLM's default add_generation_prompt is true: continuing needs it off.
            return Err(invalid(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                None,
            ));
        }
        if let Some(k) = int(o, "top_logprobs") {
            if k < -1 {
                return Err(invalid(
                    "`top_logprobs` must be a positive value or -1.",
                    Some("top_logprobs"),
                ));
            }
            if k != 0 && o.get("logprobs").and_then(Value::as_bool) != Some(true) {
                return Err(invalid(
                    "when using `top_logprobs`, `logprobs` must be set to true.",
                    Some("top_logprobs"),
                ));
            }
        }
    } else if int(o, "logprobs").is_some_and(|k| k < -1) {
        return Err(invalid(
            "`logprobs` must be a positive value or -1.",
            Some("logprobs"),
        ));
    }
    Ok(())
}

/// What a request asks of the sampler, once vLLM's `SamplingParams` admit it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Asked {
    /// Choices per prompt.
    pub n: u32,
    /// Alternatives per token to report (`None`: no logprobs).
    pub logprobs: Option<u32>,
}

/// vLLM's `SamplingParams` checks and its engine's `max_logprobs` limit.
pub(crate) fn check_sampling(o: &Map<String, Value>, chat: bool) -> Result<Asked, Refusal> {
    let n = int(o, "n").unwrap_or(1);
    if n < 1 {
        return Err(invalid(format!("n must be at least 1, got {n}."), None));
    }
    if n > MAX_N {
        return Err(invalid(
            format!("n must be at most {MAX_N}, got {n}. To increase this limit, set the VLLM_MAX_N_SEQUENCES environment variable."),
            None,
        ));
    }
    for p in ["presence_penalty", "frequency_penalty"] {
        if let Some(x) = num(o, p).filter(|x| !(-2.0..=2.0).contains(x)) {
            return Err(invalid(format!("{p} must be in [-2, 2], got {x:?}."), None));
        }
    }
    if let Some(x) = num(o, "repetition_penalty").filter(|x| *x <= 0.0) {
        return Err(invalid(
            format!("repetition_penalty must be greater than zero, got {x:?}."),
            None,
        ));
    }
    let temperature = num(o, "temperature");
    if let Some(t) = temperature {
        if t < 0.0 {
            return Err(invalid(
                format!("temperature must be non-negative, got {t:?}."),
                Some("temperature"),
            ));
        }
        if t > 2.0 {
            return Err(invalid(
                format!("temperature must be in [0, 2], got {t:?}."),
                Some("temperature"),
            ));
        }
    }
    if let Some(p) = num(o, "top_p").filter(|p| !(*p > 0.0 && *p <= 1.0)) {
        return Err(invalid(
            format!("top_p must be in (0, 1], got {p:?}."),
            Some("top_p"),
        ));
    }
    if let Some(k) = int(o, "top_k").filter(|k| *k < -1) {
        return Err(invalid(
            format!("top_k must be 0 (disable), or at least 1, got {k}."),
            None,
        ));
    }
    if let Some(p) = num(o, "min_p").filter(|p| !(0.0..=1.0).contains(p)) {
        return Err(invalid(
            format!("min_p must be in [0, 1], got {p:?}."),
            None,
        ));
    }
    let max_key = if chat && int(o, "max_completion_tokens").is_some() {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    if let Some(m) = int(o, max_key).filter(|m| *m < 1) {
        return Err(invalid(
            format!("max_tokens must be at least 1, got {m}."),
            Some("max_tokens"),
        ));
    }
    let greedy = temperature.is_some_and(|t| t < SAMPLING_EPS);
    if greedy && n > 1 {
        return Err(invalid(
            format!("n must be 1 when using greedy sampling, got {n}."),
            None,
        ));
    }
    let logprobs = if chat {
        (o.get("logprobs").and_then(Value::as_bool) == Some(true))
            .then(|| int(o, "top_logprobs").unwrap_or(0))
    } else {
        int(o, "logprobs")
    };
    let logprobs = match logprobs {
        None => None,
        Some(k) => {
            let k = if k == -1 { VOCAB_SIZE } else { k };
            if k > MAX_LOGPROBS {
                return Err(invalid(
                    format!("Requested sample logprobs of {k}, which is greater than max allowed: {MAX_LOGPROBS}"),
                    Some("logprobs"),
                ));
            }
            Some(k as u32)
        }
    };
    Ok(Asked {
        n: n as u32,
        logprobs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sampling(v: Value, chat: bool) -> Result<Asked, Refusal> {
        check_sampling(v.as_object().unwrap(), chat)
    }

    #[test]
    fn a_mistyped_field_is_pydantics_bad_request_naming_the_field() {
        let e = check_schema(&json!({"prompt": "x", "temperature": "hot"}), false).unwrap_err();
        assert_eq!(e.kind, "Bad Request");
        assert_eq!(e.param.as_deref(), Some("body.temperature"));
        assert!(e.message.contains("float_parsing"), "{}", e.message);
        let e = check_schema(&json!({"prompt": "x", "max_tokens": 1.5}), false).unwrap_err();
        assert!(e.message.contains("int_from_float"));
        assert!(check_schema(
            &json!({"prompt": "x", "max_tokens": 2.0, "stream": null}),
            false
        )
        .is_ok());
        let e = check_schema(&json!({"messages": "hi"}), true).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("body.messages"));
        assert_eq!(
            check_schema(&json!([1]), false)
                .unwrap_err()
                .param
                .as_deref(),
            Some("body")
        );
    }

    #[test]
    fn chat_and_completions_type_logprobs_differently() {
        assert!(check_schema(&json!({"messages": [], "logprobs": true}), true).is_ok());
        assert!(check_schema(&json!({"messages": [], "logprobs": 2}), true).is_err());
        assert!(check_schema(&json!({"prompt": "x", "logprobs": 2}), false).is_ok());
        assert!(check_schema(&json!({"prompt": "x", "logprobs": true}), false).is_err());
    }

    #[test]
    fn out_of_range_values_are_the_samplers_bad_request_error() {
        for (body, param) in [
            (json!({"temperature": -1}), Some("temperature")),
            (json!({"temperature": 3}), Some("temperature")),
            (json!({"top_p": 0}), Some("top_p")),
            (json!({"top_k": -5}), None),
            (json!({"n": 0}), None),
            (json!({"max_tokens": 0}), Some("max_tokens")),
            (json!({"frequency_penalty": 3}), None),
            (json!({"logprobs": 21}), Some("logprobs")),
            (json!({"logprobs": -1}), Some("logprobs")),
            (json!({"n": 2, "temperature": 0}), None),
        ] {
            let e = sampling(body.clone(), false).unwrap_err();
            assert_eq!(e.kind, "BadRequestError", "{body}");
            assert_eq!(e.param.as_deref(), param, "{body}");
        }
    }

    #[test]
    fn in_range_requests_say_how_many_choices_and_alternatives() {
        let a = sampling(json!({"n": 3, "logprobs": 0}), false).unwrap();
        assert_eq!((a.n, a.logprobs), (3, Some(0)));
        let a = sampling(
            json!({"logprobs": true, "top_logprobs": 5, "temperature": 0}),
            true,
        )
        .unwrap();
        assert_eq!((a.n, a.logprobs), (1, Some(5)));
        assert_eq!(
            sampling(json!({"top_logprobs": 5}), true).unwrap().logprobs,
            None
        );
        let e = sampling(json!({"logprobs": true, "top_logprobs": 21}), true).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("logprobs"));
    }

    #[test]
    fn validators_refuse_stream_options_without_stream_and_top_logprobs_without_logprobs() {
        let o = json!({"stream_options": {"include_usage": true}});
        assert_eq!(
            check_validators(o.as_object().unwrap(), false)
                .unwrap_err()
                .param
                .as_deref(),
            Some("stream_options")
        );
        let o = json!({"top_logprobs": 2});
        assert_eq!(
            check_validators(o.as_object().unwrap(), true)
                .unwrap_err()
                .param
                .as_deref(),
            Some("top_logprobs")
        );
        let o = json!({"logprobs": -2});
        assert_eq!(
            check_validators(o.as_object().unwrap(), false)
                .unwrap_err()
                .param
                .as_deref(),
            Some("logprobs")
        );
        let o = json!({"logprobs": true, "top_logprobs": 2, "stream": true, "stream_options": {}});
        assert!(check_validators(o.as_object().unwrap(), true).is_ok());
    }

    #[test]
    fn continuing_the_final_message_needs_the_generation_prompt_off() {
        let check = |o: Value| check_validators(o.as_object().unwrap(), true);
        // add_generation_prompt defaults to true, as in vLLM.
        let e = check(json!({"continue_final_message": true})).unwrap_err();
        assert!(
            e.message.contains("continue_final_message"),
            "{}",
            e.message
        );
        assert!(
            check(json!({"continue_final_message": true, "add_generation_prompt": true})).is_err()
        );
        assert!(
            check(json!({"continue_final_message": true, "add_generation_prompt": false})).is_ok()
        );
        assert!(check_schema(
            &json!({"messages": [], "continue_final_message": "yes"}),
            true
        )
        .is_err());
    }
}
