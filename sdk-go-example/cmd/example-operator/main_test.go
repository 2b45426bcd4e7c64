package main

import (
	"context"
	"encoding/json"
	"errors"
	"testing"

	"capstan.dev/sdk-go-example/capstan"
)

func invocation(spec map[string]any, retry int) *capstan.Invocation {
	return &capstan.Invocation{
		HandlerID: "create_fn",
		Attempt:   retry + 1,
		Retry:     retry,
		Body:      map[string]any{"spec": spec},
	}
}

func TestCreateFailsTemporarilyAsManyTimesAsAsked(t *testing.T) {
	spec := map[string]any{"fail_times": json.Number("2")}
	for retry := 0; retry < 2; retry++ {
		_, err := createFn(context.Background(), invocation(spec, retry))
		var temporary *capstan.TemporaryError
		if !errors.As(err, &temporary) {
			t.Fatalf("retry %d: want a temporary error, got %v", retry, err)
		}
	}
	if _, err := createFn(context.Background(), invocation(spec, 2)); err != nil {
		t.Fatalf("third attempt: %v", err)
	}
}

func TestNumberReadsOnlyJSONIntegers(t *testing.T) {
	for _, c := range []struct {
		in   any
		want int
	}{{json.Number("3"), 3}, {json.Number("1.5"), 0}, {"3", 0}, {nil, 0}} {
		if got := number(c.in); got != c.want {
			t.Errorf("number(%#v) = %d, want %d", c.in, got, c.want)
		}
	}
}
